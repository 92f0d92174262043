"""Streams: a policy's batches from an iterable too large to hold, in a bounded buffer.

`policy.stream(items, buffer_size=...)` reads `items` lazily into a buffer of at most
`buffer_size` items, shuffles each fill under the seed, cuts it into batches by the
policy's own rules and hands them out in steps of one batch per rank. A batch a
fill leaves short (it could take another item like its own) is not handed out: its
items join the next fill, so that a static policy's batches are full except the
last, whatever the buffer size. Every rank
runs the same steps from the same seed and keeps its own batch of each, so the ranks
agree without talking to each other, and all get the same number of batches. With
the policy's `group`, each fill is batched within the group limit (as `batches` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from batchkit.batchers.cost import BatchCost
from batchkit.batchers.groups import GroupFn
from batchkit.batchers.sampler import even_out

T = TypeVar("T")


class StreamPolicy(Protocol):
    """What a stream needs from a policy (every `Batcher` has it)."""

    @property
    def group(self) -> GroupFn | None:
        """The policy's group function; None: no groups."""
        ...

    @property
    def max_batch_size(self) -> int:
        """The most items in a batch."""
        ...

    @property
    def max_tokens(self) -> int | None:
        """The budget a batch's cost is held to; None: the size alone decides."""
        ...

    @property
    def cost(self) -> BatchCost:
        """How a batch of keys is costed against `max_tokens`."""
        ...

    def index_batches(self, keys: Sequence[float], *, shuffled: bool = False) -> list[list[int]]:
        """Batches of positions in `keys`, cut by the policy's rules.

        Args:
            keys: every item's key.
            shuffled: the keys come in a random order.
        """
        ...

    def arrange(
        self,
        batches: list[list[int]],
        keys: Sequence[float],
        *,
        world_size: int,
        rng: np.random.Generator | None,
        drop_last: bool = False,
    ) -> list[list[int]]:
        """The batches in the order ranks take them.

        Args:
            batches: batches of positions in `keys`.
            keys: every position's key.
            world_size: how many ranks take one batch each per step.
            rng: the random generator; None: keep the order.
            drop_last: the batches that do not fill a step will be dropped.
        """
        ...

    def grouped_index_batches(
        self, keys: Sequence[float], groups: Sequence[Hashable], *, shuffled: bool = False
    ) -> list[list[int]]:
        """Batches of positions in `keys`, each within the policy's group limit.

        Args:
            keys: every item's key.
            groups: every item's group.
            shuffled: the keys come in a random order.
        """
        ...

    def keys_of(self, items: Sequence[Any]) -> list[float]:
        """Every item's key.

        Args:
            items: the items.
        """
        ...

    def groups_of(self, items: Sequence[Any]) -> list[Hashable]:
        """Every item's group.

        Args:
            items: the items.
        """
        ...

    def bucket_of(self, key: float) -> Hashable:
        """The bucket of an item with this key.

        Args:
            key: the item's key.
        """
        ...


def stream_batches(
    policy: StreamPolicy,
    items: Iterable[T],
    *,
    buffer_size: int,
    seed: int,
    rank: int,
    world_size: int,
    shuffle: bool,
    sync_buckets: bool,
    drop_last: bool,
) -> Iterator[tuple[list[T], list[int]]]:
    """This rank's batches of `items`, as (items, their positions in the stream).

    Each round fills the buffer to `buffer_size` items (less the items of batches
    still held back), shuffles what it read, batches it, and yields every full step
    (`world_size` batches, one per rank): a group's last batches that do not fill a
    step wait for the next round. Groups are the policy's buckets with `sync_buckets`
    (a step never mixes buckets), else one. A batch the fill left short
    (`_could_take_more`) is not handed out while `items` go on: its items are
    batched again with the next fill's. At the end of `items` the last steps are
    evened out like a sampler's epoch (batches repeated from the start of the group,
    or dropped with `drop_last`). A buffer too small for one step's batches makes
    them go early, evened out the same way, so a stream is never stuck. With the
    policy's `group`, each fill is cut by `grouped_index_batches`: no batch holds more
    than the policy's `max_groups_per_batch` groups (batches are never merged later,
    only split by a policy's `arrange`, which keeps that).

    Args:
        policy: the batching policy.
        items: any iterable, read once, lazily.
        buffer_size: the most items held at once (read, not yet handed out).
        seed: the seed every rank shares.
        rank: this rank, in `[0, world_size)`.
        world_size: how many ranks share the stream.
        shuffle: shuffle each fill of the buffer and the order of its steps.
        sync_buckets: every step's batches come from one bucket.
        drop_last: at the end, drop batches that do not fill a step instead of
            repeating some.
    """
    rng = np.random.default_rng(seed)
    source = iter(items)
    # what is read and not yet handed out, by stream position
    held: dict[int, T] = {}
    held_keys: dict[int, float] = {}
    held_groups: dict[int, Hashable] = {}
    waiting: dict[Hashable, list[list[int]]] = {}  # group -> batches held back for a step
    carried: list[int] = []  # items of short batches, batched again with the next fill
    read = 0  # items read so far: the next item's stream position
    exhausted = False
    grouped = policy.group is not None
    while not exhausted or waiting:
        room = buffer_size - len(held)
        chunk = list(itertools.islice(source, room)) if room > 0 else []
        exhausted = exhausted or (room > 0 and len(chunk) < room)
        try:
            keys = policy.keys_of(chunk)
            groups = policy.groups_of(chunk) if grouped else None
        except (TypeError, ValueError) as exc:  # its items[i] counts from this fill's start
            raise type(exc)(f"in the stream's items from position {read}: {exc}") from exc
        positions = list(range(read, read + len(chunk)))
        read += len(chunk)
        if shuffle and chunk:
            order = rng.permutation(len(chunk)).tolist()
            chunk, positions = [chunk[i] for i in order], [positions[i] for i in order]
            keys = [keys[i] for i in order]
            if groups is not None:
                groups = [groups[i] for i in order]
        held.update(zip(positions, chunk))
        held_keys.update(zip(positions, keys))
        if groups is not None:
            held_groups.update(zip(positions, groups))
        fill = carried + positions
        fill_keys = [held_keys[p] for p in fill]
        if grouped:
            batches = policy.grouped_index_batches(fill_keys, [held_groups[p] for p in fill])
        else:
            batches = policy.index_batches(fill_keys)
        # More items are coming and there is room for them: a short batch waits for them
        carry = not exhausted and room > 0
        carried = []
        for batch in batches:
            members = [fill[p] for p in batch]
            if carry and _could_take_more(policy, [fill_keys[p] for p in batch]):
                carried += members
                continue
            group = policy.bucket_of(fill_keys[batch[0]]) if sync_buckets else None
            waiting.setdefault(group, []).append(members)
        stuck = room <= 0  # held-back batches fill the buffer: they go, buckets mixed
        if stuck:
            waiting = {None: [b for batches in waiting.values() for b in batches]}
        steps: list[list[list[int]]] = []
        for group in list(waiting):
            ordered = _arranged(
                policy,
                waiting.pop(group),
                held_keys,
                world_size,
                rng if shuffle else None,
                drop_last=drop_last and exhausted,
            )
            full = len(ordered) - len(ordered) % world_size
            if exhausted or (stuck and full == 0):
                ordered = even_out(ordered, world_size, drop_last)
                full = len(ordered)
            elif ordered[full:]:
                waiting[group] = ordered[full:]
            steps += [ordered[s : s + world_size] for s in range(0, full, world_size)]
        if shuffle and len(steps) > 1:
            steps = [steps[i] for i in rng.permutation(len(steps)).tolist()]
        for step in steps:
            mine = step[rank]
            yield [held[i] for i in mine], list(mine)
        # what is held now: the batches waiting for a step and the carried items (a
        # batch repeated to even out a step can come again in this round, so items
        # are freed only here)
        kept = [i for batches in waiting.values() for b in batches for i in b] + carried
        held = {i: held[i] for i in kept}
        held_keys = {i: held_keys[i] for i in kept}
        held_groups = {i: held_groups[i] for i in kept if i in held_groups}
        if exhausted and not waiting:
            return


def _could_take_more(policy: StreamPolicy, keys: list[float]) -> bool:
    """Whether a batch with `keys` could take another item like its longest: fewer than
    `max_batch_size` items and, under a token budget, room for that item's cost."""
    if len(keys) >= policy.max_batch_size:
        return False
    budget = policy.max_tokens
    return budget is None or policy.cost.of([*keys, max(keys)]) <= budget


def _arranged(
    policy: StreamPolicy,
    batches: list[list[int]],
    held_keys: dict[int, float],
    world_size: int,
    rng: np.random.Generator | None,
    *,
    drop_last: bool,
) -> list[list[int]]:
    """`batches` (of stream positions) in the order the policy's `arrange` gives them."""
    flat = [i for b in batches for i in b]
    keys = [held_keys[i] for i in flat]
    local: list[list[int]] = []
    start = 0
    for b in batches:
        local.append(list(range(start, start + len(b))))
        start += len(b)
    arranged = policy.arrange(local, keys, world_size=world_size, rng=rng, drop_last=drop_last)
    return [[flat[p] for p in b] for b in arranged]
