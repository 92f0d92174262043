"""A type checker sees the item and result types of a `@batched` function: its callers'
items are checked and their results typed, for sync and async functions, methods and
streams (`batched_types.py` holds the cases; mypy checks them)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from typing_extensions import get_overloads

from batchkit.serve.batched import BatchedDecorator, batched

CASES = Path(__file__).with_name("batched_types.py")
ROOT = CASES.parent.parent.parent
EXPECTED_ERROR = re.compile(r"#\s*error:\s*([\w-]+)\s*$")
REPORTED_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[\w-]+)\]$")

# Only batched.py is analysed: its annotations are the contract here, and the rest of
# the package (what its options' types come from) would take a minute of mypy's time.
# Errors are read from the cases alone (`mypy batchkit` checks the package itself).
CONFIG = """\
[mypy]
strict = True
python_version = 3.10
[mypy-batchkit.*]
follow_imports = skip
ignore_errors = True
[mypy-batchkit.serve.batched]
follow_imports = normal
"""


def expected_errors() -> set[tuple[str, int, str]]:
    """(path, line, code) of every line of the cases marked `# error: CODE`."""
    lines = CASES.read_text().splitlines()
    path = str(CASES.relative_to(ROOT))
    found = {
        (path, n, m.group(1))
        for n, line in enumerate(lines, 1)
        if (m := EXPECTED_ERROR.search(line))
    }
    assert found, f"{CASES.name} marks no line with '# error: CODE'"
    return found


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (the test extra)"
)
def test_callers_items_are_checked_and_results_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mypy import api

    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    monkeypatch.chdir(ROOT)  # mypy finds batchkit in this checkout, whatever is installed
    stdout, stderr, _ = api.run(
        [
            f"--config-file={config}",
            f"--cache-dir={os.devnull}",
            "--no-error-summary",
            str(CASES.relative_to(ROOT)),
        ]
    )
    assert not stderr, stderr
    errors = [line for line in stdout.splitlines() if ": error: " in line]
    unparsed = [line for line in errors if not REPORTED_ERROR.match(line)]
    assert not unparsed, "\n".join(unparsed)
    reported = {
        (m["path"], int(m["line"]), m["code"])
        for m in map(REPORTED_ERROR.match, errors)
        if m is not None
    }
    expected = expected_errors()
    assert reported == expected, (
        f"errors not expected: {sorted(reported - expected)}; expected errors missing: "
        f"{sorted(expected - reported)}\n{stdout}"
    )


def test_the_decorator_with_options_types_a_function_as_bare_batched_does() -> None:
    def typings(overloads: Sequence[Callable[..., object]]) -> list[tuple[str, str]]:
        """(the function's annotation, the return annotation) of each overload."""
        signatures = [inspect.signature(o) for o in overloads]
        return [(str(s.parameters["fn"].annotation), str(s.return_annotation)) for s in signatures]

    bare = [o for o in get_overloads(batched) if "fn" in inspect.signature(o).parameters]
    assert len(bare) >= 2
    assert typings(get_overloads(BatchedDecorator.__call__)) == typings(bare)
