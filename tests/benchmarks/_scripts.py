"""Loading a script of benchmarks/ as a module, to test its parts."""

from __future__ import annotations

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
