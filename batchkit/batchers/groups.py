"""Grouped batching: every batch holds items of at most `max_groups_per_batch` groups.

A policy's `group=` maps an item to a hashable group (its model, adapter, task or a
flag). Offline, in a sampler and in a stream the positions are first split into
*pools* of at most `max_groups_per_batch` groups: the groups in order of first
appearance, `max_groups_per_batch` consecutive ones to a pool, a pool's positions
group after group (each group's in their given order). Each pool is then batched by
the policy's own rules (size, token budget, buckets, sorting), so no batch leaves its
pool, and none holds more groups than its pool has.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from batchkit.batchers.checks import positive_count

GroupFn = Callable[[Any], Hashable]


class GroupedBucket(NamedTuple):
    """Where a grouped request waits online: its group and the policy's bucket of its
    key. A batch never mixes buckets, so each holds one group; `max_groups_per_batch`
    fills a short one from the buckets of other groups with the same `bucket`."""

    group: Hashable
    bucket: Hashable


def check_group_options(group: object, max_groups_per_batch: object) -> int | None:
    """The `max_groups_per_batch` to store: 1 when `group` is given without it.

    Args:
        group: the policy's `group=` (a callable, or None).
        max_groups_per_batch: the policy's `max_groups_per_batch=` (None: the default).

    Returns:
        The limit as an int, or None for a policy without `group`.

    Raises:
        TypeError: `group` is not callable.
        ValueError: `max_groups_per_batch` without `group`, or not a whole number >= 1.
    """
    if group is None:
        if max_groups_per_batch is not None:
            raise ValueError(
                f"max_groups_per_batch={max_groups_per_batch!r} needs group=: without a "
                "group function there are no groups to limit"
            )
        return None
    if not callable(group):
        raise TypeError(f"group must be callable, got {type(group).__name__}")
    if max_groups_per_batch is None:
        return 1
    return positive_count("max_groups_per_batch", max_groups_per_batch)


def checked_group(value: object) -> Hashable:
    """`value`, the result of `group(item)`, if it is hashable.

    Args:
        value: what `group(item)` returned.

    Raises:
        TypeError: `value` is not hashable (a dict or set cannot tell groups apart).
    """
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"group(item) must return a hashable value, got {type(value).__name__}"
        ) from None
    return value


def group_codes(groups: Sequence[Hashable] | np.ndarray, count: int) -> np.ndarray:
    """Each entry's group as a number: 0 for the first group seen, 1 for the next, ...

    Args:
        groups: one hashable group per dataset index (a sequence or 1-d array).
        count: how many there must be (the dataset's length).

    Raises:
        TypeError: `groups` is not a sequence or array, or an entry is not hashable
            (named by its position).
        ValueError: `groups` and the lengths differ in length.
    """
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (Sequence, np.ndarray)):
        raise TypeError(f"groups must be a sequence, got {type(groups).__name__}")
    if len(groups) != count:
        raise ValueError(
            f"groups has {len(groups)} entries but lengths has {count}: give one group per length"
        )
    seen: dict[Hashable, int] = {}
    codes = np.empty(count, dtype=np.int64)
    for i, g in enumerate(groups):
        try:
            codes[i] = seen.setdefault(g, len(seen))
        except TypeError:
            raise TypeError(f"groups[{i}] must be hashable, got {type(g).__name__}") from None
    return codes


def pools(groups: Sequence[Hashable], max_groups: int) -> list[list[int]]:
    """Positions in `groups`, in pools of at most `max_groups` groups each.

    Groups in order of first appearance, `max_groups` consecutive ones to a pool; a
    pool's positions come group after group, each group's in their order in `groups`.

    Args:
        groups: every position's group.
        max_groups: the most groups in one pool.
    """
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    ordered = list(members.values())
    return [
        [i for group in ordered[start : start + max_groups] for i in group]
        for start in range(0, len(ordered), max_groups)
    ]
