"""Importing a file that is not on the import path (an example, a benchmark script)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module(path: Path, name: str) -> ModuleType:
    """Import the file at `path` as module `name`.

    The module is registered in `sys.modules` before it runs: dataclasses and pydantic
    look a class's module up by name while the file executes.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
