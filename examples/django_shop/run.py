"""The Django shop: an order and its tasks in one ``transaction.atomic()`` block.

    python examples/django_shop/run.py [--dir FOLDER] [--postgresql postgresql://user@host/db]

``manage.py migrate`` creates the shop's tables and sqlease's; a worker
(``celery -A shop worker``) runs; an order whose payment is declined rolls back and leaves no
task; committed orders are shipped (a Celery task) and receipted (a Django task), and the time
each waited between its commit and its start is printed. Exits 0 when all of that held.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # example_support.py, shared by the examples

from example_support import say, wait_for  # noqa: E402

ORDERS = 5


def start_worker(folder: Path) -> subprocess.Popen[bytes]:
    log = (folder / "worker.log").open("ab")
    command = [sys.executable, "-m", "celery", "-A", "shop", "worker", "-Q", "celery,default"]
    command += ["--pool", "threads", "-c", "2", "-l", "info", "-n", "shop@%h"]
    command += ["--without-mingle", "--without-gossip"]
    return subprocess.Popen(
        command, cwd=HERE, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT
    )


def scenario(folder: Path) -> list[str]:
    import django

    django.setup()
    from shop.models import Order, Receipt, Shipment
    from shop.services import PaymentDeclined, place_order

    import sqlease

    manage = [sys.executable, str(HERE / "manage.py")]
    say("[1] $ manage.py migrate   (the shop's tables and sqlease's)")
    done = subprocess.run([*manage, "migrate"], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"migrate failed: {done.stdout}{done.stderr}")
    admin = sqlease.Admin("sqlease+django://default")

    worker = start_worker(folder)
    try:
        wait_for("the worker", lambda: "ready." in (folder / "worker.log").read_text(), 60)
        say("[2] a worker runs: celery -A shop worker -Q celery,default")

        say("[3] an order whose payment is declined, inside transaction.atomic()")
        try:
            place_order("a lamp", declined=True)
        except PaymentDeclined as exc:
            say(f"    PaymentDeclined({exc}): the block rolled back")
        rolled_back = [t for t in admin.tasks(limit=100)]
        time.sleep(1.5)  # the worker would have run a stray task by now
        say(f"    orders: {Order.objects.count()}, tasks known to sqlease: {len(rolled_back)}")

        say(f"[4] {ORDERS} orders committed, one atomic() block each, one after the other")
        waits = []
        for n in range(ORDERS):
            order, shipping, receipt = place_order(f"book {n}")
            committed = time.time()  # the block has committed: the tasks exist from now on
            outcome = shipping.get(timeout=60)
            wait_for("the receipt", lambda r=receipt: _finished(r), 60)
            started = Shipment.objects.get(order=order).started_at
            waits.append((started - committed) * 1000)
            say(
                f"    order {order.id}: ship -> {outcome}; send_receipt -> "
                f"{receipt.return_value!r} (Django task {receipt.status}); "
                f"ship started {waits[-1]:.1f} ms after the commit"
            )
        say(
            f"    commit -> task start: median {statistics.median(waits):.1f} ms, "
            f"max {max(waits):.1f} ms"
        )
    finally:
        worker.terminate()
        worker.wait(30)

    failures = []
    if rolled_back:
        failures.append(f"the declined order left tasks: {rolled_back}")
    if Order.objects.count() != ORDERS:
        failures.append(f"expected {ORDERS} orders, found {Order.objects.count()}")
    if Shipment.objects.count() != ORDERS or Receipt.objects.count() != ORDERS:
        failures.append("every committed order must be shipped and receipted exactly once")
    if not failures:
        say("OK: the declined order left no task; every committed order ran, once")
    return failures


def _finished(result: Any) -> bool:
    result.refresh()
    return bool(result.is_finished)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="folder for the SQLite database and the worker's log")
    parser.add_argument("--postgresql", help="a PostgreSQL database URL instead of SQLite")
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="sqlease-django-shop-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("django_shop.db", "django_shop.db-wal", "django_shop.db-shm", "worker.log"):
        (folder / name).unlink(missing_ok=True)
    os.environ["SHOP_DIR"] = str(folder)
    if args.postgresql:
        os.environ["SHOP_DATABASE_URL"] = args.postgresql
    os.environ["DJANGO_SETTINGS_MODULE"] = "shop.settings"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )
    say(f"database: {'PostgreSQL' if args.postgresql else folder / 'django_shop.db'}")
    try:
        failures = scenario(folder)
    except Exception as exc:
        failures = [f"{type(exc).__name__}: {exc}"]
    for failure in failures:
        say(f"FAILED: {failure}")
    if failures:
        log = folder / "worker.log"
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        say(f"--- worker log ---\n{tail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
