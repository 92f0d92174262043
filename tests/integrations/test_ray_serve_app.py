"""examples/ray_serve_app.py ends cleanly: its replicas drain and Ray stops without
reporting a task it killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason='the Ray tests need the ray extra: pip install -e ".[test,ray]"')

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_serve_example_shuts_down_without_killing_a_task() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_serve_app.py"), "--requests", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "64 requests, every result equals the unbatched one" in done.stdout
    # serve.shutdown() made Ray kill its controller mid-task: "(raylet) Task
    # ServeController.graceful_shutdown failed ... killed by `ray.kill`".
    assert "ray.kill" not in output and "Task ServeController" not in output, output[-3000:]
