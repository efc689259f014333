"""The runnable examples under ``examples/``: each ``run.py`` runs its whole scenario with real
``celery worker`` processes on embedded SQLite, checks the outcome itself and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# example -> lines its run.py prints only when every check held
EXPECTED = {
    "checkpoints": [
        "killed worker 1 with SIGKILL after page",
        "OK: resumed from page ",
        "on attempt 2; each of the 10 pages was imported exactly once",
    ],
    "steps": [
        "killed worker 1 with SIGKILL",
        "OK: one charge (ch_",
        "attempt 2 returned the receipt stored by attempt 1",
    ],
    "approval": [
        "  state        waiting_approval\n",
        "approved ",
        "OK: order 42 refunded once after approval from the CLI; order 43 rejected",
    ],
    "django_shop": [
        "orders: 0, tasks known to sqlease: 0",
        "commit -> task start: median",
        "OK: the declined order left no task; every committed order ran, once",
    ],
    "outbox": [
        "seen from another connection before the commit: False",
        "OK: shipped exactly the committed order; the rolled-back order left no task",
    ],
}


def test_every_example_is_tested() -> None:
    found = {p.parent.name for p in EXAMPLES.glob("*/run.py")}
    assert found == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_verifies_itself(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("SQLEASE_EXAMPLE_DIR", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name / "run.py"), "--dir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    took = time.monotonic() - started
    output = f"exit {done.returncode} after {took:.1f} s\n{done.stdout}\n--- stderr ---\n"
    output += done.stderr
    assert done.returncode == 0, output
    for line in EXPECTED[name]:
        assert line in done.stdout, output
    assert (tmp_path / f"{name}.db").exists(), output  # the database went where it was told
    assert took < 60, output
