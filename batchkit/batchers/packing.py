"""Packing: batches that fill a token budget, for padding-free layouts (`pack_varlen`).

[`PackingBatcher`][batchkit.PackingBatcher] forms batches whose cost (by default the
sum of the keys: the tokens of one packed sequence) stays within `max_tokens`, by
best-fit decreasing: the longest item first, each into the open batch it fills most
tightly. As a sampler it also balances the ranks: the batches of each step (one per
rank) carry about the same tokens, so no rank waits for a slower one.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

import numpy as np

from batchkit.batchers.base import Batcher, C, KeyFn
from batchkit.batchers.checks import positive_count
from batchkit.batchers.cost import SUM, BatchCost, CostLike
from batchkit.batchers.groups import GroupFn
from batchkit.batchers.sampler import split_at


class PackingBatcher(Batcher):
    """Batches packed by best-fit decreasing within a token budget.

    Each batch's cost (`cost=`, by default `"sum"`: the sum of its keys) stays within
    `max_tokens`; an item whose key alone is over the budget goes alone.

    - Offline, [`batches`][batchkit.Batcher.batches] packs the whole input: items in
      decreasing key order, each into the open batch it fills most tightly (a new one
      when none has room), so batches come out nearly full; a batch's items are in
      decreasing key order.
    - Online, under `@batched`, a batch is the oldest waiting request plus the other
      waiting requests, in service order, that still fit the budget (one too long is
      skipped, not the end of the batch): a budget-filling policy for padding-free
      models.
    - As a sampler ([`sampler`][batchkit.Batcher.sampler]) and in
      [`stream`][batchkit.Batcher.stream], every rank gets the same number of
      batches, each index exactly once (batches are split in two to reach a multiple
      of the ranks rather than an index repeated; only when there are fewer items
      than that multiple are some repeated), and each step's batches (one per rank)
      carry about the same tokens. With `drop_last=True` nothing is split: the
      lightest batches that do not fill a step are dropped, so every step is full.

    With the default `cost="sum"`, integer keys and no `max_batch_size`, packing runs
    over a table of the open batches' free room (vectorized: a million lengths in well
    under a second); another cost or a size limit uses a plain loop over open batches.

    Args:
        max_tokens: the budget each batch of more than one item stays within.
        key: an item's key (default `len`).
        cost: what `max_tokens` bounds: `"sum"` (the default), `"padded"` or a callable
            `cost(keys) -> number` ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).
        max_batch_size: the most items in one batch; None: the budget alone decides
            (online, at most `max_tokens` items per batch; zero-length items, which
            cost nothing, go in batches of at most `max_tokens` of their own).
        max_wait_ms: online, how long the oldest waiting request may wait, in
            milliseconds.
        group: an item's group (its model, adapter, task...), any hashable value;
            a batch holds items of at most `max_groups_per_batch` groups. None: no
            groups.
        max_groups_per_batch: the most groups in one batch (default 1 with `group`;
            needs `group`).

    Raises:
        ValueError: `max_tokens` or `max_batch_size` not a positive int, or a bad wait.
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        key: KeyFn = len,
        cost: CostLike | BatchCost = "sum",
        max_batch_size: int | None = None,
        max_wait_ms: float = 5.0,
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
    ) -> None:
        max_tokens = positive_count("max_tokens", max_tokens)
        max_batch_size = positive_count("max_batch_size", max_batch_size, allow_none=True)
        super().__init__(
            # keys >= 1 within a sum budget fit at most max_tokens to a batch; the online
            # scheduler needs a number for its caps
            max_batch_size=max_tokens if max_batch_size is None else max_batch_size,
            max_wait_ms=max_wait_ms,
            max_tokens=max_tokens,
            key=key,
            cost=cost,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
        )
        self.size_limited = max_batch_size is not None

    @property
    def candidate_limit(self) -> int | None:
        """Packing looks at every waiting request (a later, shorter one may fit)."""
        return None

    # -- offline ----------------------------------------------------------
    def index_batches(self, keys: Sequence[float], *, shuffled: bool = False) -> list[list[int]]:
        """Batches of positions in `keys`, packed by best-fit decreasing.

        Equal keys are taken in their order in `keys` (a sampler's random order).

        Args:
            keys: every item's key.
            shuffled: the keys come in a random order (packing does not depend on it).
        """
        return [b.tolist() for b in self._pack(np.asarray(keys, dtype=np.float64))]

    def arrange(
        self,
        batches: list[list[int]],
        keys: Sequence[float],
        *,
        world_size: int,
        rng: np.random.Generator | None,
        drop_last: bool = False,
    ) -> list[list[int]]:
        """Batches in steps of `world_size` whose costs are balanced.

        First the batch count is made a multiple of `world_size` by splitting the
        batches with the most items in two (never an index twice; not with
        `drop_last`, where the fewest tokens are left for the caller to drop instead,
        so every step stays full); then the batches,
        sorted by cost, are cut into consecutive steps of `world_size`, so each step's
        batches cost about the same; with `rng`, the steps and the rank each batch of a
        step goes to are shuffled. What cannot be split stays last, for the caller to
        even out.

        Args:
            batches: batches of positions in `keys`.
            keys: every position's key.
            world_size: how many ranks take one batch each per step.
            rng: the epoch's random generator; None: no shuffling.
            drop_last: the caller drops what does not fill a step.
        """
        arrays = [np.asarray(b, dtype=np.int64) for b in batches]
        keyed = np.asarray(keys, dtype=np.float64)
        balanced = self._balanced(arrays, keyed, world_size, rng, drop_last)
        return [b.tolist() for b in balanced]

    def plan(
        self,
        keys: np.ndarray,
        *,
        shuffled: bool,
        world_size: int,
        rng: np.random.Generator | None,
        drop_last: bool = False,
        groups: Sequence[Hashable] | None = None,
    ) -> list[np.ndarray]:
        """Packed batches, balanced across ranks, as arrays (no list per batch).

        Args:
            keys: every position's key.
            shuffled: the keys come in a random order.
            world_size: how many ranks take one batch each per step.
            rng: the epoch's random generator; None: keep the order.
            drop_last: the caller drops what does not fill a step.
            groups: every position's group: each pool of `max_groups_per_batch`
                groups (1 without `group`) is packed on its own. None: no groups.
        """
        keyed = np.asarray(keys, dtype=np.float64)
        if groups is None:
            packed = self._pack(keyed)
        else:  # (splitting a batch in two for the ranks keeps both halves in its pool)
            grouped = self.grouped_index_batches(keyed.tolist(), groups, shuffled=shuffled)
            packed = [np.asarray(b, dtype=np.int64) for b in grouped]
        return self._balanced(packed, keyed, world_size, rng, drop_last)

    def _pack(self, keys: np.ndarray) -> list[np.ndarray]:
        budget = self.max_tokens
        assert budget is not None  # set in __init__
        if self.cost is SUM and not self.size_limited and _integral(keys):
            return _best_fit_decreasing_sums(keys.astype(np.int64), budget, self.max_batch_size)
        return [np.asarray(b, dtype=np.int64) for b in self._best_fit_decreasing(keys.tolist())]

    def _best_fit_decreasing(self, keys: list[float]) -> list[list[int]]:
        """Best fit decreasing by the policy's own cost and size limit (a loop over the
        open batches for every item)."""
        budget = self.max_tokens
        assert budget is not None
        limit = self.max_batch_size if self.size_limited else len(keys)
        order = sorted(range(len(keys)), key=lambda i: -keys[i])  # stable: ties in order
        batches: list[list[int]] = []
        open_: list[int] = []  # batches that may still take an item
        zeros: list[int] | None = None  # the open batch of zero keys, without a size limit
        for i in order:
            if keys[i] == 0 and not self.size_limited:
                # As the sums' path: they cost nothing, so they go among themselves, at
                # most max_tokens to a batch (as many as the online scheduler takes).
                if zeros is None or len(zeros) >= self.max_batch_size:
                    batches.append(zeros := [])
                zeros.append(i)
                continue
            best, best_cost = -1, -1.0
            for b in open_:
                members = batches[b]
                if len(members) >= limit:
                    continue
                cost = self.cost.of([keys[j] for j in members] + [keys[i]])
                if best_cost < cost <= budget:
                    best, best_cost = b, cost
            if best < 0:
                batches.append([i])
                if keys[i] <= budget:  # an item over the budget goes alone
                    open_.append(len(batches) - 1)
            else:
                batches[best].append(i)
        return batches

    def _balanced(
        self,
        batches: list[np.ndarray],
        keys: np.ndarray,
        world_size: int,
        rng: np.random.Generator | None,
        drop_last: bool,
    ) -> list[np.ndarray]:
        if not batches:
            return batches
        if not drop_last:
            batches = _split_to_multiple(batches, keys, world_size)
        if self.cost is SUM:
            sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
            starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            costs = np.add.reduceat(keys[np.concatenate(batches)], starts)
        else:
            costs = np.array([self.cost.of(keys[b].tolist()) for b in batches])
        by_cost = np.argsort(-costs, kind="stable")
        steps = len(batches) // world_size
        grid = by_cost[: steps * world_size].reshape(steps, world_size)
        if rng is not None:
            grid = grid[rng.permutation(steps)]
            grid = np.take_along_axis(grid, rng.random(grid.shape).argsort(axis=1), axis=1)
        order = [*grid.reshape(-1).tolist(), *by_cost[steps * world_size :].tolist()]
        return [batches[i] for i in order]

    # -- online -----------------------------------------------------------
    def select(self, candidates: Sequence[C]) -> list[C]:
        """The oldest waiting request plus every later one, in order, that still fits.

        Args:
            candidates: the waiting requests, in service order.
        """
        budget = self.max_tokens
        assert budget is not None
        chosen = [candidates[0]]
        keys = [candidates[0].key]
        for c in candidates[1:]:
            if len(chosen) == self.max_batch_size:
                break
            if self.cost.of([*keys, c.key]) <= budget:
                chosen.append(c)
                keys.append(c.key)
        return chosen


def _integral(array: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(array)) and np.all(array == np.floor(array)))


def _split_to_multiple(
    batches: list[np.ndarray], keys: np.ndarray, world_size: int
) -> list[np.ndarray]:
    """`batches` with some split in two until their count is a multiple of `world_size`
    (as far as batches of two or more items allow): the ones with the most items."""
    need = -len(batches) % world_size
    if need == 0:
        return batches
    sizes = [len(b) for b in batches]
    batches = list(batches)
    for _ in range(need):
        b = int(np.argmax(sizes))
        if sizes[b] < 2:
            break
        # alternate the items, longest first, so the halves carry about equal tokens
        members = batches[b][np.argsort(-keys[batches[b]], kind="stable")]
        batches[b] = members[0::2]
        batches.append(members[1::2])
        sizes[b] = len(batches[b])
        sizes.append(len(batches[-1]))
    return batches


def _best_fit_decreasing_sums(keys: np.ndarray, budget: int, max_items: int) -> list[np.ndarray]:
    """Best-fit decreasing of integer `keys` into batches whose sum is within `budget`.

    The open batches are kept in stacks by their free room. The items of one size go
    together: the tightest room `r >= size` takes `r // size` of them in each of its
    batches (after one, the batch's room `r - size` is the tightest that still fits,
    if it fits), so the work grows with the distinct sizes and rooms, not the items.
    Items of key 0 go in batches of their own (of at most `max_items`); items over the
    budget alone.
    """
    n = len(keys)
    bin_of = np.empty(n, dtype=np.int64)
    order = np.argsort(-keys, kind="stable")
    sorted_keys = keys[order]
    sizes, starts, counts = np.unique(-sorted_keys, return_index=True, return_counts=True)
    stacks: dict[int, list[int]] = {}  # free room -> open batches with that room
    rooms: list[int] = []  # the rooms with open batches, ascending
    next_bin = 0

    def push(room: int, bins: list[int]) -> None:
        stack = stacks.get(room)
        if stack is None:
            stacks[room] = stack = []
            bisect.insort(rooms, room)
        stack.extend(bins)

    for neg_size, start, count in zip(sizes.tolist(), starts.tolist(), counts.tolist()):
        size = -neg_size
        members = order[start : start + count]
        if size > budget or size == 0:  # alone, or zero-cost items among themselves
            per = 1 if size else max_items
            nb = -(-count // per)
            bin_of[members] = next_bin + np.arange(count) // per
            next_bin += nb
            continue
        p = 0
        while p < count:
            i = bisect.bisect_left(rooms, size)
            if i == len(rooms):  # no open batch fits: new ones, each filled with this size
                per = budget // size
                left = count - p
                bin_of[members[p:]] = next_bin + np.arange(left) // per
                full, last = divmod(left, per)
                push(budget - per * size, list(range(next_bin, next_bin + full)))
                if last:
                    push(budget - last * size, [next_bin + full])
                next_bin += full + (1 if last else 0)
                break
            room = rooms[i]
            stack = stacks[room]
            per = room // size
            whole = min(len(stack), (count - p) // per)
            if whole:
                bins = stack[len(stack) - whole :]
                del stack[len(stack) - whole :]
                bin_of[members[p : p + whole * per]] = np.repeat(bins, per)
                p += whole * per
                push(room - per * size, bins)
            if p < count and stack:  # fewer than `per` left: one batch takes them all
                last = count - p
                b = stack.pop()
                bin_of[members[p:]] = b
                p = count
                push(room - last * size, [b])
            if not stack:
                del stacks[room]
                rooms.pop(bisect.bisect_left(rooms, room))
    # group the positions by batch, each batch in decreasing key order
    if n == 0:
        return []
    grouped = order[np.argsort(bin_of[order], kind="stable")]
    return split_at(grouped, np.bincount(bin_of, minlength=next_bin))
