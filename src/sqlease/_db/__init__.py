"""The database layer: the only code that knows a dialect.

- ``driver.py``: ``Driver``, the one seam: one method per operation (``message_claim``,
  ``message_ack``, ``message_publish``, ``result_put``, …), each returning an ``Op`` built
  without I/O (``ops.py``: ops, lanes and their parameters), and the transactions
  (``reading``, ``writing``) everything above runs through;
- ``dialects.py``: the registry, the one place that chooses a dialect by name;
- ``statements.py``: ``Statements``, the statements both dialects have (the facades' and the
  core's own reads and writes), and ``Capabilities``, what a database can do;
- ``sql_common.py``: the statements and fragments identical on both dialects;
- ``postgresql/`` and ``sqlite/``: each dialect's driver (its operations), its own statements
  (one module per aggregate, its constants in ``dialect.py``), its engine, its waker, its
  schema steps, and its ``entry`` (the dialect as the registry knows it);
- ``engine.py`` (process-wide engines), ``migrations.py``, ``tables.py``, ``rows.py`` (rows to
  values), ``translate.py`` (driver errors to sqlease's), ``retry.py``, ``spares.py``.

Statements are SQL text because the PostgreSQL claim is a chain of data-modifying CTEs that
SQLAlchemy's expression language would only obscure; table names come from the validated
prefix. A builder takes what varies (the tables, one queue or several) as parameters and
composes its text from f-string fragments.

Time: every statement takes ``:now`` (epoch milliseconds). When it is NULL the database's own
clock is used, so that on PostgreSQL all workers compare leases against one clock whatever their
own clocks say; tests bind a fake clock instead.

Fence lists: one statement handles a whole batch. PostgreSQL binds two arrays (``:ids``,
``:attempts``) and unnests them; SQLite binds one JSON array of ``[message_id, attempt]`` pairs
(``:fences``) and reads it with ``json_each``.
"""
