"""Argument checks the policies, the samplers and `@batched`'s options share.

One rule throughout: a value of the wrong type (a string, a bool, None where a
number is needed) raises TypeError; a number of the right type that is out of range
(below 1, not whole, NaN, infinite, longer than the platform's timers take) raises
ValueError. Both messages name the argument and quote the value given.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Literal, overload

# The longest wait `threading` can time (`Event.wait`, `Condition.wait`): a longer one
# raises OverflowError inside a worker or the timer thread, long after the option
# was taken. About 292 years on 64-bit platforms.
LONGEST_WAIT_S: float = threading.TIMEOUT_MAX


def is_real_number(value: object) -> bool:
    """Whether `value` is a real number and not a bool (numpy scalars count).

    Args:
        value: any value.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_flag(name: str, value: object) -> bool:
    """`value` if it is True or False.

    A truthy string (`"false"`) or `0`/`1` is a mistake rather than a choice.

    Args:
        name: the argument's name, for the message.
        value: the value to check.

    Raises:
        TypeError: `value` is not a bool.
    """
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_callable(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise TypeError unless `value` is callable (or None when allowed).

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too.
    """
    if value is None and allow_none:
        return
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}")


def _wrong_type(name: str, wanted: str, value: object) -> TypeError:
    return TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise unless `value` is a positive int (or None when allowed).

    For a value its caller stores as given; where the caller stores what
    [`positive_count`][batchkit.batchers.checks.positive_count] returns, that one also
    takes a whole-number float such as `2.0`.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too.

    Raises:
        TypeError: `value` is not an int (a bool is not one).
        ValueError: `value` is below 1.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong_type(name, "a positive int", value)
    if value < 1:
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
        TypeError: `value` is not a number (a string, a bool, None when not allowed).
        ValueError: `value` is a number but not a positive whole one (the message
            names it).
    """
    if value is None and allow_none:
        return None
    if not is_real_number(value):
        raise _wrong_type(name, "a positive int", value)
    given = value
    if isinstance(value, numbers.Integral):
        value = int(value)  # numpy ints too: the stored count is a plain int
    elif math.isfinite(value) and float(value).is_integer():  # type: ignore[arg-type]
        value = int(float(value))  # type: ignore[arg-type]
    if not isinstance(value, int) or value < 1:
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
    """`value` as a wait in milliseconds: a real number from 0 to what timers take.

    The one check of a wait, for a policy's `max_wait_ms` and for a live
    `configure(max_wait_ms=...)` alike: a bool is refused (`True` is not "1 ms").

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too (and is returned).

    Returns:
        The wait as a float (None when `value` is None and that is allowed).

    Raises:
        TypeError: `value` is not a number (the message names it).
        ValueError: `value` is negative, NaN, or longer than the platform's timers
            take (`threading.TIMEOUT_MAX` seconds, `LONGEST_WAIT_S`).
    """
    if value is None and allow_none:
        return None
    return duration(name, value, unit="ms", allow_zero=True)


def duration(
    name: str, value: object, *, unit: Literal["s", "ms"], allow_zero: bool = False
) -> float:
    """`value` as a time span in `unit`: a number above 0 (or >= 0) that timers take.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        unit: what `value` counts, seconds or milliseconds.
        allow_zero: 0 passes too.

    Returns:
        The span as a float, in `unit`.

    Raises:
        TypeError: `value` is not a number (a string, a bool, None).
        ValueError: `value` is below 0 (or 0 when not allowed), NaN, infinite, or
            longer than `threading.TIMEOUT_MAX` seconds.
    """
    words = "seconds" if unit == "s" else "milliseconds"
    floor = ">= 0" if allow_zero else "> 0"
    if not is_real_number(value):
        raise _wrong_type(name, f"a number of {words} {floor}", value)
    span = float(value)  # type: ignore[arg-type]
    if not (span >= 0 if allow_zero else span > 0) or not math.isfinite(span):
        raise ValueError(f"{name} must be a finite number of {words} {floor}, got {value!r}")
    longest = LONGEST_WAIT_S * (1000.0 if unit == "ms" else 1.0)
    if span > longest:
        raise ValueError(
            f"{name}={value!r} is longer than this platform's timers take "
            f"(threading.TIMEOUT_MAX: {longest:.4g} {words})"
        )
    return span
