"""The API reference (docs/api/*.md) documents every public name, each by an explicit
path that the docs generator resolves to that very object (never to a module that
shadows it, as the ``batchkit.collate.pad`` module shadows the ``pad`` function), and
reads as Markdown: no Sphinx role in any docstring, every parameter of the reference
in an ``Args:`` section."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import griffe  # a test dependency: the reference is read as the docs build reads it
import pytest

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
    "batchkit.integrations.transformers",
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


# Docstrings are rendered as Markdown (mkdocstrings, Google style): a Sphinx role such
# as :class:`X` shows up as raw text. Cross-references are written [`X`][batchkit.X].
SPHINX_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|attr|data|mod|exc|obj|const|ref):`")

def relative_file(obj: Any) -> str:
    return Path(obj.filepath).resolve().relative_to(ROOT).as_posix()


def modules(module: Any) -> list[Any]:
    """``module`` and every module under it (griffe objects, not aliases)."""
    out = [module]
    for member in module.members.values():
        if not member.is_alias and member.is_module:
            out.extend(modules(member))
    return out


def documented_objects(obj: Any) -> list[Any]:
    """``obj`` and every object defined inside it (not submodules) that has a docstring."""
    out = [obj] if obj.docstring is not None else []
    for member in obj.members.values():
        if not member.is_alias and not member.is_module:
            out.extend(documented_objects(member))
    return out


def sphinx_roles_by_file() -> dict[str, list[str]]:
    """file -> ``path: role`` for every Sphinx role in a docstring under batchkit/."""
    found: dict[str, list[str]] = {}
    for module in modules(package()):
        for obj in documented_objects(module):
            for role in SPHINX_ROLE.findall(obj.docstring.value):
                found.setdefault(relative_file(obj), []).append(f"{obj.path}: {role}")
    return found


def test_docstrings_use_markdown_cross_references_not_sphinx_roles() -> None:
    offending = [hit for _, hits in sorted(sphinx_roles_by_file().items()) for hit in hits]
    assert not offending, (
        "Sphinx roles render as raw text; write [`Name`][batchkit.Name]:\n" + "\n".join(offending)
    )


def is_public_method(name: str) -> bool:
    return not name.startswith("_") or name == "__call__"


# A ``::: path`` entry whose options hide the signature: a class that is not
# constructed directly (``pad`` returns a ``Padded``), so its constructor is no API.
HIDDEN_SIGNATURE = re.compile(r"^:::\s*(\S+)\s*\n(?:[ \t]+.*\n)*?[ \t]+show_signature: false", re.M)


def reference_callables() -> dict[str, Any]:
    """path -> griffe object for every function, method and class of the reference.

    A class stands for its constructor (``__init__``, merged into the class on the
    page) unless its entry hides the signature, and brings its public methods along.
    """
    hidden = {path for page in API_PAGES for path in HIDDEN_SIGNATURE.findall(page.read_text())}
    out: dict[str, Any] = {}
    for _, path in directives():
        target = rendered(path)
        if target.is_function:
            out[target.path] = target
        elif target.is_class:
            if path not in hidden:
                out[target.path] = target
            for name, member in target.members.items():
                if not member.is_alias and member.is_function and is_public_method(name):
                    out[member.path] = member
    return out


def parameter_names(function: Any) -> list[str]:
    names = []
    for parameter in function.parameters:
        # A private dataclass field (``_offsets``) is no parameter a user passes.
        if parameter.name in ("self", "cls") or parameter.name.startswith("_"):
            continue
        stars = {"variadic positional": "*", "variadic keyword": "**"}.get(parameter.kind.value, "")
        names.append(stars + parameter.name)
    return names


def documented_names(*objects: Any) -> set[str]:
    """Names listed in the Args (and, for records, Attributes) sections of ``objects``."""
    names: set[str] = set()
    for obj in objects:
        if obj is None or obj.docstring is None:
            continue
        for section in obj.docstring.parse("google", warnings=False):
            if section.kind.value in ("parameters", "other parameters", "attributes"):
                names.update(item.name for item in section.value)
    return names


def undocumented_parameters(obj: Any) -> list[str]:
    """Parameters of ``obj`` (a function, or a class's constructor) that no Args names."""
    if obj.is_class:
        init = obj.all_members.get("__init__")
        if init is None or init.is_alias and init.final_target.parent.path == "builtins.object":
            return []
        function = init.final_target if init.is_alias else init
        documented = documented_names(obj, function)
        # A dataclass field documented where it is declared is documented on the page.
        if "dataclass" in obj.labels:
            documented.update(name for name, member in obj.members.items() if member.docstring)
    else:
        function = obj
        documented = documented_names(obj)
    # "*" and "**" spellings both count for variadic parameters.
    return [
        name
        for name in parameter_names(function)
        if name not in documented and name.lstrip("*") not in documented
    ]


def undocumented_by_file() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path, obj in reference_callables().items():
        missing = undocumented_parameters(obj)
        if missing:
            found.setdefault(relative_file(obj), []).append(f"{path}({', '.join(missing)})")
    return found


def test_every_parameter_in_the_reference_is_documented() -> None:
    offending = [hit for _, hits in sorted(undocumented_by_file().items()) for hit in hits]
    assert not offending, "parameters missing from the Args: section:\n" + "\n".join(offending)
