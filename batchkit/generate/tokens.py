"""Token ids in and out of the continuous batcher: what counts as one, and the checks.

A token id is an int in ``[0, MAX_TOKEN_ID]`` (int64 in every layout); numpy and torch
integers are accepted and converted. Ids are checked where they enter: prompts and
stop ids at submit (an error names the position), a step's sampled tokens before any
is applied (a bad one fails only its own sequence; so does an exception instance, with
itself).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

MAX_TOKEN_ID = 2**63 - 1


class _Scheduled(Protocol):
    start: int
    num_tokens: int
    token_ids: list[int]


def is_index(value: Any) -> bool:
    """Whether ``value`` is an integer (``operator.index`` accepts it).

    Args:
        value: Any value (numpy and torch integers count).
    """
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _all_ints(values: list[Any]) -> bool:
    return set(map(type, values)) <= {int}  # C-level: the common case costs no Python loop


def token_ids(ids: Iterable[Any], what: str) -> list[int]:
    """``ids`` as a list of token ids; anything else raises, naming its position
    (``what[i]``), before it can reach a step.

    Args:
        ids: The ids (ints, numpy or torch integers).
        what: The argument's name, for the errors (``"prompt_ids"``).

    Raises:
        TypeError: An id is not an integer.
        ValueError: An id is outside ``[0, MAX_TOKEN_ID]``.
    """
    out = list(ids)
    if not _all_ints(out):
        try:
            out = list(map(operator.index, out))
        except TypeError:
            i, bad = next((i, t) for i, t in enumerate(out) if not is_index(t))
            raise TypeError(
                f"{what}[{i}] is {bad!r} ({type(bad).__name__}), not an integer token id"
            ) from None
    if out and (min(out) < 0 or max(out) > MAX_TOKEN_ID):
        i, bad = next((i, t) for i, t in enumerate(out) if not 0 <= t <= MAX_TOKEN_ID)
        raise ValueError(f"{what}[{i}] is {bad}, outside the token ids [0, {MAX_TOKEN_ID}]")
    return out


def check_step_tokens(
    seqs: Sequence[_Scheduled], tokens: list[Any]
) -> tuple[list[Any], dict[int, str | BaseException]]:
    """Check a step's results, one per sequence (already the right number).

    Args:
        seqs: The step's sequences, in order.
        tokens: The step function's results, in the same order.

    Returns:
        The tokens with integer-likes as ints (a non-integer replaced by None), and
        the bad entries by position, each with what was wrong (None where the
        sequence must sample, not an integer, outside the token ids), or the
        exception instance the entry was (the step's error for that sequence).
    """
    bad: dict[int, str | BaseException] = {}
    if None in tokens:
        for i, (sched, token) in enumerate(zip(seqs, tokens)):
            if token is None and sched.start + sched.num_tokens == len(sched.token_ids):
                bad[i] = "None, but it reached its last token and must sample"
        sampled: list[Any] = [t for t in tokens if t is not None]
    else:
        sampled = tokens
    if not _all_ints(sampled):  # numpy / torch integers: converted once here
        tokens = _as_token_ids(tokens, bad)
        sampled = [t for t in tokens if t is not None]
    if sampled and (min(sampled) < 0 or max(sampled) > MAX_TOKEN_ID):
        for i, token in enumerate(tokens):
            if token is not None and not 0 <= token <= MAX_TOKEN_ID:
                bad[i] = f"{token}, outside the token ids [0, {MAX_TOKEN_ID}]"
    return tokens, bad


def _as_token_ids(tokens: list[Any], bad: dict[int, str | BaseException]) -> list[int | None]:
    """``tokens`` with integer-likes as ints; any other entry is recorded in ``bad`` (by
    position) and replaced by None."""
    out: list[int | None] = []
    for i, token in enumerate(tokens):
        if isinstance(token, BaseException):
            bad[i] = token
            out.append(None)
            continue
        try:
            out.append(None if token is None else operator.index(token))
        except TypeError:
            bad[i] = f"{token!r} ({type(token).__name__}), not an integer token id"
            out.append(None)
    return out
