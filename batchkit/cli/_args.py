"""Argument types and the one error the commands raise for a bad argument."""

from __future__ import annotations

import argparse
import math
import re
import sys


class CliError(Exception):
    """A bad argument or input found after parsing: one line on stderr, exit status 2."""


def _check_size(value: int, text: str) -> int:
    # Sizes and counts past sys.maxsize fail deep inside (islice, numpy, float overflow).
    if value > sys.maxsize:
        raise argparse.ArgumentTypeError(f"expected an integer up to {sys.maxsize}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An int in [1, sys.maxsize].

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return _check_size(value, text)


def non_negative_int(text: str) -> int:
    """An int in [0, sys.maxsize].

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return _check_size(value, text)


def _float(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        what = "a positive number" if positive else "a number >= 0"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0.

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    return _float(text, positive=True)


def non_negative_float(text: str) -> float:
    """A finite float >= 0.

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    return _float(text, positive=False)


def fraction(text: str) -> float:
    """A float in [0, 1).

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    value = _float(text, positive=False)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _items(text: str, what: str) -> list[str]:
    """The comma- or space-separated parts of ``text``; an error naming ``what`` if none."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
    return parts


def int_list(text: str) -> list[int]:
    """``"1,2,4,8"`` -> positive ints (separated by commas or spaces).

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    return [positive_int(p) for p in _items(text, "integers")]


def float_list(text: str) -> list[float]:
    """``"0,2.5,5"`` -> numbers >= 0.

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    return [non_negative_float(p) for p in _items(text, "numbers")]


def shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` or ``"3x224x224"`` -> a shape of positive dimensions.

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is not one (argparse prints the message).
    """
    parts = re.split(r"\s*[,x]\s*", text.strip().strip("()[]").strip())
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected a shape such as 3,224,224, got {text!r}")
    try:
        return tuple(positive_int(p) for p in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a shape of positive integers such as 3,224,224, got {text!r}"
        ) from None
