"""Argument checks the policies and the samplers share."""

from __future__ import annotations


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise ValueError unless `value` is a positive int (or None when allowed).

    Args:
        name: the argument's name, for the message.
        value: the value to check.
        allow_none: None passes too.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
