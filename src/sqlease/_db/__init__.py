"""The lease store's SQL: one builder function per statement, per dialect.

- ``statements.py``: ``Statements``, the collection a ``Store`` builds once for its dialect and
  table prefix (``store.sql.claim``: one attribute lookup on the hot path), and
  ``Capabilities``, what a dialect can do in one statement;
- ``dialects.py``: a dialect by name (``dialect_for``, ``statements_for``);
- ``sql_common.py``: the statements and fragments identical on both dialects;
- ``postgresql/`` and ``sqlite/``: each dialect's own statements, one module per aggregate
  (messages, leases, events; offers and results on PostgreSQL), and its constants in
  ``dialect.py``.

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
