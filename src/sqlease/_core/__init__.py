"""The lease domain: the store's operations by aggregate, on the database layer's driver."""
