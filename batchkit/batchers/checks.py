"""Argument checks the policies and the samplers share."""

from __future__ import annotations

import math
import numbers
from typing import Literal, overload


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise ValueError unless `value` is a positive int (or None when allowed).

    For a value its caller stores as given; where the caller stores what
    [`positive_count`][batchkit.batchers.checks.positive_count] returns, that one also
    takes a whole-number float such as `2.0`.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@overload
def positive_count(name: str, value: object, *, allow_none: Literal[False] = False) -> int: ...
@overload
def positive_count(name: str, value: object, *, allow_none: bool) -> int | None: ...
def positive_count(name: str, value: object, *, allow_none: bool = False) -> int | None:
    """`value` as a positive int: an int, or a whole-number float (`2.0`).

    A count read from YAML or JSON often arrives as a float (`max_batch_size: 1.0`);
    Ray Serve takes it, and so does this. Any other float (`1.5`, NaN, infinity) and
    a bool are refused, as are numbers below 1. Store the returned value, never the
    given one, so that the count is an int from here on.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too (and is returned).

    Returns:
        The count as a Python int (None when `value` is None and that is allowed).

    Raises:
        ValueError: `value` is not a positive whole number (the message names it).
    """
    if value is None and allow_none:
        return None
    given = value
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, numbers.Integral))
        and math.isfinite(value)
        and float(value).is_integer()
    ):
        value = int(float(value))
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # numpy ints too: the stored count is a plain int
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{name} must be a positive int (a whole-number float such as 2.0 is taken), "
            f"got {given!r}"
        )
    return value


@overload
def wait_ms(name: str, value: object, *, allow_none: Literal[False] = False) -> float: ...
@overload
def wait_ms(name: str, value: object, *, allow_none: bool) -> float | None: ...
def wait_ms(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """`value` as a wait in milliseconds: a finite real number >= 0.

    The one check of a wait, for a policy's `max_wait_ms` and for a live
    `configure(max_wait_ms=...)` alike: a bool is refused (`True` is not "1 ms").

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too (and is returned).

    Returns:
        The wait as a float (None when `value` is None and that is allowed).

    Raises:
        ValueError: `value` is not a finite number >= 0 (the message names it).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    wait = float(value)
    if not (wait >= 0 and math.isfinite(wait)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return wait
