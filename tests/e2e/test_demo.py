"""The README's first command: the demo kills a worker mid-task and the task resumes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_resumes_a_killed_task_from_its_checkpoint(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sqlease", "demo", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "killed worker 1 with SIGKILL" in done.stdout
    assert "nothing lost, nothing redone." in done.stdout
    assert "attempt 2  claimed" in done.stdout
