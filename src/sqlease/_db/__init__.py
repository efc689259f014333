"""The database layer: the only code that knows how PostgreSQL and SQLite differ."""
