"""The dashboard's read models, beyond ``Admin``'s verbs: ``views`` (workers, throughput,
keyset pages of tasks, runs, a task's payload, result and history), ``task_list`` (the rows
of the tasks list, and the page of succeeded tasks) and ``history`` (a task's history as a
person reads it). SQLAlchemy Core and plain functions, no web framework."""
