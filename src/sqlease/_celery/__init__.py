"""What the Kombu transport, the Celery result backend and beat share in a process: the
durable defaults and the worker's warning (``defaults``, connected when ``sqlease`` or
``sqlease_autoload`` is imported), the tasks' concurrency and uniqueness options turned into
headers (``task_limits``, a ``before_task_publish`` handler) and one store per database
(``registry``).

Nothing is imported here: importing ``sqlease._celery.registry`` connects no signal, and the
import of ``defaults`` stays where it is timed (``sqlease/__init__.py``, ``sqlease_autoload``).
"""
