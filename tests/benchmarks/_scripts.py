"""Loading a script of benchmarks/ as a module, to test its parts; or running it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests._modules import load_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str, as_name: str | None = None) -> ModuleType:
    """benchmarks/`name`.py, imported (its own imports of the folder's helpers work)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return load_module(BENCHMARKS / f"{name}.py", as_name or name)


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/`name`.py with `args` in a process of its own, from the repository
    root (this checkout's batchkit first on the path); its output captured as text."""
    root = BENCHMARKS.parent
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
