"""The ``@batched`` page and its API reference entry show every option of
``batchkit.batched`` with the default a caller really gets."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import griffe  # a test dependency: the reference is read as the docs build reads it

import batchkit

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "batched.md"
# The Griffe extension the docs build loads (mkdocs.yml names it).
EXTENSION = "docs/_ext/overload_defaults.py:OverloadDefaults"


def keyword_options() -> list[str]:
    """The options of ``@batched``: its keyword-only parameters (``fn`` is the function)."""
    return [
        p.name
        for p in inspect.signature(batchkit.batched).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def effective_defaults() -> dict[str, Any]:
    """Each option's default as a caller gets it, read from the running code.

    A setting the function reports (``configure()``) is read from a function made with
    no options, since the implementation takes None for "not given" there; the rest
    are the implementation's own defaults.
    """
    f = batchkit.batched(lambda xs: xs)
    try:
        settings = f.configure()
    finally:
        f.close()
    defaults = {}
    for name in keyword_options():
        if hasattr(settings, name):
            defaults[name] = getattr(settings, name)
        else:
            defaults[name] = inspect.signature(batchkit.batched).parameters[name].default
    return defaults


def literal(text: str) -> Any:
    """The value a default written in the docs or a signature stands for."""
    return ast.literal_eval(text)


def options_table() -> dict[str, str]:
    """option -> default cell of the page's options table (header ``| option | default |``)."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*option\s*\|\s*default", line))
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def test_the_options_table_lists_every_option_of_batched_with_its_real_default() -> None:
    table = options_table()
    assert sorted(table) == sorted(keyword_options())
    wrong = {
        name: (table[name], value)
        for name, value in effective_defaults().items()
        if literal(table[name]) != value
    }
    assert not wrong, f"(page says, code does): {wrong}"


def test_the_real_defaults_are_what_the_docs_have_always_said() -> None:
    # The two the implementation leaves to the default policy.
    defaults = effective_defaults()
    assert (defaults["max_batch_size"], defaults["max_wait_ms"]) == (32, 5.0)


@cache
def reference_batched() -> Any:
    """``batchkit.batched`` as the docs build reads it, with the build's extension."""
    extensions = griffe.load_extensions(EXTENSION)
    loader = griffe.GriffeLoader(search_paths=[str(ROOT), *sys.path], extensions=extensions)
    return loader.load("batchkit")["serve.batched.batched"]


def test_the_docs_build_loads_the_extension_this_test_reads_with() -> None:
    assert f"- {EXTENSION}" in (ROOT / "mkdocs.yml").read_text()


def test_the_reference_signatures_show_each_option_with_its_real_default() -> None:
    # The overloads that take options (without collate and split, so that the
    # function's types reach its callers; with them; with `state`): each shows every
    # option, with the default the code uses.
    options_overloads = [o for o in reference_batched().overloads if len(o.parameters) > 1]
    assert len(options_overloads) >= 2
    for options_overload in options_overloads:
        rendered = {p.name: str(p.default) for p in options_overload.parameters}
        assert sorted(rendered) == sorted(keyword_options())
        wrong = {
            name: (rendered[name], value)
            for name, value in effective_defaults().items()
            if rendered[name] == "..." or literal(rendered[name]) != value
        }
        assert not wrong, f"(signature shows, code does): {wrong}"


def test_the_reference_parameter_table_shows_each_option_with_its_real_default() -> None:
    function = reference_batched()
    (parameters,) = [
        s.value for s in function.docstring.parse("google") if s.kind.value == "parameters"
    ]
    shown = {p.name: str(p.default) for p in parameters}
    wrong = {
        name: (shown[name], value)
        for name, value in effective_defaults().items()
        if literal(shown[name]) != value
    }
    assert not wrong, f"(Default column shows, code does): {wrong}"
