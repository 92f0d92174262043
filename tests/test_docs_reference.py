"""The API reference (docs/api/*.md) documents every public name, each by an explicit
path that the docs generator resolves to that very object (never to a module that
shadows it, as the ``batchkit.collate.pad`` module shadows the ``pad`` function)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parent.parent
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))

# Every module whose ``__all__`` is the public API a user imports from.
PUBLIC_MODULES = [
    "batchkit",
    "batchkit.collate",
    "batchkit.batchers",
    "batchkit.kv",
    "batchkit.generate",
    "batchkit.serve",
    "batchkit.metrics",
    "batchkit.tools.memory",
    "batchkit.integrations.ray",
]

DIRECTIVE = re.compile(r"^:::\s*(\S+)\s*$", re.M)


def directives() -> list[tuple[str, str]]:
    """(page name, documented path) for every ``::: path`` line of the reference."""
    return [(page.name, path) for page in API_PAGES for path in DIRECTIVE.findall(page.read_text())]


# Packages whose names batchkit re-exports; mkdocs.yml preloads the same ones.
PRELOADED = ["prometheus_client"]


@cache
def package() -> Any:
    """batchkit as the docs generator sees it (static analysis, aliases resolved)."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT), *sys.path])
    batchkit = loader.load("batchkit")
    for name in PRELOADED:
        if importlib.util.find_spec(name) is not None:
            loader.load(name)
    loader.resolve_aliases()
    return batchkit


def rendered(path: str) -> Any:
    """The object that ``::: path`` renders, aliases followed to their target."""
    obj = package()[path.removeprefix("batchkit.")] if path != "batchkit" else package()
    return obj.final_target if obj.is_alias else obj


def runtime_object(canonical_path: str) -> Any:
    """The Python object at ``canonical_path`` (a defining module, then attributes)."""
    parts = canonical_path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(canonical_path)


def public_names() -> list[tuple[str, str]]:
    """(module, name) for every non-module name in every public ``__all__``."""
    out = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not isinstance(getattr(module, name), types.ModuleType):
                out.append((module_name, name))
    return out


@pytest.mark.parametrize(("page", "path"), directives(), ids=lambda v: str(v))
def test_each_reference_entry_renders_the_public_object_it_names(page: str, path: str) -> None:
    private = [p for p in path.split(".") if p.startswith("_") and not p.endswith("__")]
    assert not private, f"{page}: ::: {path} documents a private name"
    target = rendered(path)
    assert target.kind.value != "module", (
        f"{page}: ::: {path} renders the module {target.path}, not a function or class; "
        "name the object by its defining path (e.g. batchkit.collate.pad.pad)"
    )
    obj = runtime_object(target.path)
    if isinstance(obj, type):
        assert target.kind.value == "class", f"{page}: ::: {path} renders a {target.kind.value}"
    elif callable(obj):
        assert target.kind.value == "function", f"{page}: ::: {path} renders a {target.kind.value}"


def test_every_public_name_is_in_the_reference() -> None:
    documented = {id(runtime_object(rendered(path).path)) for _, path in directives()}
    missing = [
        f"{module}.{name}"
        for module, name in public_names()
        if id(getattr(importlib.import_module(module), name)) not in documented
    ]
    assert not missing, f"missing from docs/api/*.md: {', '.join(missing)}"
