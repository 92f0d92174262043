"""Running the ``batchkit`` command in-process, and what its failures must look like."""

from __future__ import annotations

import pytest

from batchkit.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``batchkit *argv``: its exit status, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 2 and one ``error:`` line holding every needle, no traceback."""
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last
    for needle in needles:
        assert needle in last, last
