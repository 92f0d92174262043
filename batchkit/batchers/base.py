"""What every batching policy shares: the `Batch` type, options, token budgets.

A policy decides *which items go together and when*. It never owns a queue or a
thread: offline, [`Batcher.batches`][batchkit.Batcher.batches] groups a finite list;
online, the one scheduler in `batchkit.serve.scheduler` asks the policy which bucket
an item belongs to, how to pick a batch from a bucket's waiting items, and how long
to wait. A token budget (`max_tokens`) bounds each batch's cost, as the policy's
[`BatchCost`][batchkit.batchers.cost.BatchCost] computes it; a `group` function keeps
each batch within `max_groups_per_batch` groups (`batchkit.batchers.groups`).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

# Re-exported: @batched and the simulator import it from here.
from batchkit.batchers.checks import positive_count, wait_ms
from batchkit.batchers.cost import PADDED, BatchCost, CostLike, as_batch_cost
from batchkit.batchers.groups import GroupFn, check_group_options, checked_group, pools
from batchkit.batchers.sampler import BatchSampler, check_non_negative_int, check_rank
from batchkit.batchers.stream import stream_batches
from batchkit.collate.shapes import ShapeBuckets
from batchkit.usercode import contained

T = TypeVar("T")

KeyFn = Callable[[Any], float]
R = TypeVar("R")


class Batch(list[T], Generic[T]):
    """A list of items plus `indices`: each item's position in the input.

    Args:
        items: the batch's items.
        indices: each item's position in the sequence the batches were cut from.
    """

    __slots__ = ("indices",)

    def __init__(self, items: Iterable[T] = (), indices: Iterable[int] = ()) -> None:
        super().__init__(items)
        self.indices: list[int] = list(indices)

    def __repr__(self) -> str:
        return f"Batch({list.__repr__(self)}, indices={self.indices})"


class Candidate(Protocol):
    """What the online scheduler shows a policy about one waiting request."""

    @property
    def key(self) -> float:
        """The item's key (its length, by default); 0.0 when the policy has no key."""
        ...


C = TypeVar("C", bound=Candidate)


def take_within_budget(
    keys: Iterable[float],
    max_batch_size: int,
    max_tokens: int | None,
    cost: BatchCost = PADDED,
) -> int:
    """How many of `keys` (in order) fit one batch.

    At most `max_batch_size`, and the batch's `cost` stays within `max_tokens`. The
    first item is always taken, so an item over the budget alone goes alone; the
    first item that takes the cost over the budget ends the batch (later, smaller
    items are not tried).

    Args:
        keys: the candidates' keys, in the order they would join.
        max_batch_size: the most items.
        max_tokens: the budget `cost` is held to; None: the size alone decides.
        cost: how a batch of keys is costed (default: the padded area).
    """
    if max_tokens is None:
        return sum(1 for _ in itertools.islice(keys, max_batch_size))
    count = 0
    running = cost.running()
    for k in keys:
        if count == max_batch_size:
            break
        if running.add(k) > max_tokens and count:
            break
        count += 1
    return count


def cut(
    order: Sequence[int],
    keys: Sequence[float],
    max_batch_size: int,
    max_tokens: int | None,
    cost: BatchCost = PADDED,
) -> Iterator[list[int]]:
    """Cut `order` into consecutive batches within the limits.

    Args:
        order: indices into `keys`, in the order batches are cut.
        keys: every item's key.
        max_batch_size: the most items per batch.
        max_tokens: the budget each batch's `cost` is held to; None: no budget.
        cost: how a batch of keys is costed (default: the padded area).

    Yields:
        Each batch's indices, in `order`.
    """
    if max_tokens is None:  # the size alone decides: plain chunks
        for start in range(0, len(order), max_batch_size):
            yield list(order[start : start + max_batch_size])
        return
    start = 0
    while start < len(order):
        # a lazy view of the rest: slicing order[start:] would copy it for every batch
        rest = (keys[order[j]] for j in range(start, len(order)))
        n = take_within_budget(rest, max_batch_size, max_tokens, cost)
        yield list(order[start : start + n])
        start += n


class Batcher:
    """Base class of the batching policies (static, dynamic, bucketed, sorted, packing).

    Subclasses set the options and override the hooks; the online scheduler and
    the offline [`batches`][batchkit.Batcher.batches] are written once, here and in
    `batchkit.serve`.

    Args:
        max_batch_size: the most items in one batch.
        max_wait_ms: how long, in milliseconds, the oldest waiting request may wait
            before a partial batch leaves; None: never before full (static batching).
        max_tokens: the most a batch of more than one item may cost, in the units of
            `cost` (tokens, for lengths); None: no budget, the size alone decides.
        key: an item's key (its length); defaults to `len` when `max_tokens` is set.
        cost: what `max_tokens` bounds: `"padded"` (`len(batch) * max(key)`, the
            default), `"sum"` (`sum(key)`) or a callable `cost(keys) -> number`; see
            [`as_batch_cost`][batchkit.batchers.cost.as_batch_cost].
        group: an item's group (its model, adapter, task...), any hashable value;
            called once per item. None: no groups.
        max_groups_per_batch: the most groups in one batch (a whole number >= 1;
            1 when `group` is given without it). Needs `group`.
        shapes: a [`ShapeBuckets`][batchkit.ShapeBuckets] grid: an item's key (its
            length; `len` unless `key` says otherwise) picks the grid length it is
            padded to, which is its bucket (a batch never spans two); a batch is
            called at the grid's smallest batch size that holds it (padded up by
            repeating its last item); a key above the grid's largest length is
            refused. `max_batch_size` is lowered to the grid's largest batch size.

    Raises:
        ValueError: a size, budget, wait or group limit that is not a positive int /
            finite number >= 0, `max_groups_per_batch` without `group`, or an
            unknown `cost` name.
        TypeError: a `key`, `group` or `cost` that is not callable, a `cost` that
            fails on a sample of keys, or `shapes` that is not a `ShapeBuckets`.
    """

    max_batch_size: int
    max_wait_s: float | None  # None: never leave before full (static batching)
    max_tokens: int | None
    key: KeyFn | None
    cost: BatchCost
    group: GroupFn | None
    max_groups_per_batch: int | None  # an int exactly when `group` is set
    shapes: ShapeBuckets | None
    key_given: bool  # `key` was chosen, not defaulted (a collator's length may replace it)

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_wait_ms: float | None,
        max_tokens: int | None = None,
        key: KeyFn | None = None,
        cost: CostLike | BatchCost = "padded",
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
        shapes: ShapeBuckets | None = None,
    ) -> None:
        max_batch_size = positive_count("max_batch_size", max_batch_size)
        if shapes is not None:
            if not isinstance(shapes, ShapeBuckets):
                raise TypeError(f"shapes must be a ShapeBuckets, got {type(shapes).__name__}")
            max_batch_size = min(max_batch_size, shapes.max_batch_size)
        max_tokens = positive_count("max_tokens", max_tokens, allow_none=True)
        max_groups_per_batch = check_group_options(group, max_groups_per_batch)
        max_wait_ms = wait_ms("max_wait_ms", max_wait_ms, allow_none=True)
        if key is not None and not callable(key):
            raise TypeError(f"key must be callable, got {type(key).__name__}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = None if max_wait_ms is None else max_wait_ms / 1000.0
        self.max_tokens = max_tokens
        self.key_given = key is not None
        self.key = len if key is None and (max_tokens is not None or shapes) else key
        self.shapes = shapes
        self.cost = as_batch_cost(cost)
        self.group = group
        self.max_groups_per_batch = max_groups_per_batch

    # -- hooks ------------------------------------------------------------
    def key_of(self, item: Any) -> float:
        """The item's key (length by default), or 0.0 when the policy uses none.

        Args:
            item: one input item.

        Raises:
            TypeError: `key(item)` is not a number.
            ValueError: `key(item)` is NaN, or negative under a token budget.
        """
        if self.key is None:
            return 0.0
        value = self.key(item)
        if type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)  # numpy scalars pass
        ):
            raise TypeError(f"key(item) must return a number, got {type(value).__name__}")
        key = float(value)
        if not key >= 0 and (self.max_tokens is not None or key != key):
            # NaN sorts and buckets nowhere consistently; a negative size makes a token
            # budget meaningless (its padded area would be negative).
            raise ValueError(f"key(item) must be a number >= 0, got {value!r}")
        if self.shapes is not None and key > self.shapes.max_length:
            self.shapes.length_for(value, item="an item")  # raises, naming its length
        return key

    def keys_of(self, items: Sequence[Any]) -> list[float]:
        """[`key_of`][batchkit.Batcher.key_of] of every item; an error names the item's position.

        Args:
            items: the input items.
        """
        return _each_item(self.key_of, items, "key", type(self).__name__)

    def group_of(self, item: Any) -> Hashable:
        """The item's group: `group(item)`, or None when the policy has no `group`.

        The user's own exception from `group` propagates unchanged.

        Args:
            item: one input item.

        Raises:
            TypeError: `group(item)` is not hashable.
        """
        if self.group is None:
            return None
        return checked_group(self.group(item))

    def groups_of(self, items: Sequence[Any]) -> list[Hashable]:
        """[`group_of`][batchkit.Batcher.group_of] of every item; an error names the
        item's position, as [`keys_of`][batchkit.Batcher.keys_of] does.

        Args:
            items: the input items.
        """
        return _each_item(self.group_of, items, "group", type(self).__name__)

    def bucket_of(self, key: float) -> Hashable:
        """Which bucket an item belongs to; a batch never mixes buckets. With
        `shapes`, the index of the grid length the item is padded to.

        Args:
            key: the item's key.
        """
        return None if self.shapes is None else self.shapes.bucket_of(key)

    def offline_order(self, keys: Sequence[float]) -> list[list[int]]:
        """Groups of item indices, each in the order batches are cut from it.

        Args:
            keys: every item's key, in input order.
        """
        if self.shapes is None:
            return [list(range(len(keys)))]
        buckets: dict[int, list[int]] = {}  # with shapes, one group per grid length
        for i, k in enumerate(keys):
            buckets.setdefault(self.shapes.bucket_of(k), []).append(i)
        return [buckets[b] for b in sorted(buckets)]

    def sampler_order(self, keys: Sequence[float]) -> list[list[int]]:
        """Like [`offline_order`][batchkit.Batcher.offline_order], for keys in a random order.

        A shuffling sampler uses this hook; by default it is `offline_order`.

        Args:
            keys: every item's key, in the sampler's (random) order.
        """
        return self.offline_order(keys)

    def select(self, candidates: Sequence[C]) -> list[C]:
        """Pick a batch from one bucket's waiting requests.

        The longest prefix whose cost stays within `max_tokens` (and at most
        `max_batch_size`); the first request always goes.

        Args:
            candidates: the bucket's waiting requests, in service order.
        """
        if self.max_tokens is None:
            return list(candidates[: self.max_batch_size])
        n = take_within_budget(
            (c.key for c in candidates), self.max_batch_size, self.max_tokens, self.cost
        )
        return list(candidates[:n])

    def padded_size(self, size: int) -> int:
        """The batch size the function is called with for `size` real items: `size`,
        or with `shapes` the grid's smallest batch size >= `size`.

        Args:
            size: the real items in the batch.
        """
        return size if self.shapes is None else self.shapes.batch_size_for(size)

    def budget_reached(self, keys: Sequence[float]) -> bool:
        """Whether a batch of `keys` uses all of `max_tokens` (False without a budget).

        The online scheduler calls it on a bucket's waiting requests: a bucket whose
        requests reach the budget is as full as one at `max_batch_size`.

        Args:
            keys: the waiting requests' keys, in service order.
        """
        return self.max_tokens is not None and self.cost.of(keys) >= self.max_tokens

    @property
    def candidate_limit(self) -> int | None:
        """How many waiting requests [`select`][batchkit.Batcher.select] needs (None: all)."""
        return self.max_batch_size

    @property
    def dispatch_when_idle(self) -> bool:
        """Whether waiting requests leave at once when no batch is running."""
        return self.max_wait_s is not None

    def arrange(
        self,
        batches: list[list[int]],
        keys: Sequence[float],
        *,
        world_size: int,
        rng: np.random.Generator | None,
        drop_last: bool = False,
    ) -> list[list[int]]:
        """The batches in the order ranks take them: batch `i` goes to rank `i % world_size`.

        A sampler and [`stream`][batchkit.Batcher.stream] call it on each epoch's (or
        buffer's) batches; by default it shuffles their order with `rng`. The caller
        evens the count out to a multiple of `world_size` afterwards.

        Args:
            batches: batches of positions in `keys`.
            keys: every position's key.
            world_size: how many ranks take one batch each per step.
            rng: the epoch's random generator; None: keep the order.
            drop_last: the caller will drop the batches that do not fill a step
                (a policy that could split batches to fill it need not).
        """
        if rng is None:
            return batches
        return [batches[i] for i in rng.permutation(len(batches)).tolist()]

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
        """A sampler's batches of positions in `keys`, in the order ranks take them.

        [`index_batches`][batchkit.Batcher.index_batches] (with `groups`,
        [`grouped_index_batches`][batchkit.Batcher.grouped_index_batches]) then
        [`arrange`][batchkit.Batcher.arrange]; a policy may compute both at once on
        arrays (`PackingBatcher` does).

        Args:
            keys: every position's key, in the sampler's order.
            shuffled: the keys come in a random order.
            world_size: how many ranks take one batch each per step.
            rng: the epoch's random generator; None: keep the order.
            drop_last: the caller will drop the batches that do not fill a step.
            groups: every position's group, parallel to `keys`; a batch holds at most
                `max_groups_per_batch` of them (1 without `group`). None: no groups.
        """
        listed = keys.tolist()
        if groups is None:
            batches = self.index_batches(listed, shuffled=shuffled)
        else:
            batches = self.grouped_index_batches(listed, groups, shuffled=shuffled)
        arranged = self.arrange(
            batches, listed, world_size=world_size, rng=rng, drop_last=drop_last
        )
        return [np.asarray(b, dtype=np.int64) for b in arranged]

    # -- offline ----------------------------------------------------------
    def index_batches(self, keys: Sequence[float], *, shuffled: bool = False) -> list[list[int]]:
        """Batches of positions in `keys`, cut by this policy's rules.

        Args:
            keys: every item's key.
            shuffled: the keys come in a random order (a training sampler), so the
                groups come from [`sampler_order`][batchkit.Batcher.sampler_order]
                instead of [`offline_order`][batchkit.Batcher.offline_order].
        """
        groups = self.sampler_order(keys) if shuffled else self.offline_order(keys)
        return [
            b for g in groups for b in cut(g, keys, self.max_batch_size, self.max_tokens, self.cost)
        ]

    def grouped_index_batches(
        self, keys: Sequence[float], groups: Sequence[Hashable], *, shuffled: bool = False
    ) -> list[list[int]]:
        """Batches of positions in `keys`, each holding at most `max_groups_per_batch` groups.

        The positions are split into pools of at most `max_groups_per_batch` groups (1
        for a policy without `group`): the groups in order of first appearance in
        `groups`, that many consecutive ones to a pool, a pool's positions group after
        group. Each pool is cut by [`index_batches`][batchkit.Batcher.index_batches]
        (the policy's own rules), and the batches come pool after pool: with one group
        a batch, each group's batches one after another, the groups in order of first
        appearance.

        Args:
            keys: every position's key.
            groups: every position's group (hashable), parallel to `keys`.
            shuffled: the keys come in a random order (a training sampler).

        Raises:
            ValueError: `groups` and `keys` differ in length.
        """
        if len(groups) != len(keys):
            raise ValueError(
                f"groups has {len(groups)} entries but keys has {len(keys)}: give one group per key"
            )
        batches: list[list[int]] = []
        for pool in pools(groups, self.max_groups_per_batch or 1):
            cut_pool = self.index_batches([keys[i] for i in pool], shuffled=shuffled)
            batches += ([pool[j] for j in b] for b in cut_pool)
        return batches

    def batches(self, items: Sequence[T]) -> Iterator[Batch[T]]:
        """Group a finite sequence of items into batches; indices cover every item once.

        With `group`, every batch holds items of at most `max_groups_per_batch` groups:
        see [`grouped_index_batches`][batchkit.Batcher.grouped_index_batches] (with one
        group a batch, each group's batches one after another, the groups in order of
        first appearance).

        Args:
            items: the items to batch (read once into a list).

        Yields:
            Each [`Batch`][batchkit.Batch], its `indices` the items' input positions.

        Raises:
            TypeError: a key that is not a number, or a group that is not hashable
                (the message names the item: `items[3]: ...`).
            ValueError: a key that is NaN, or negative under a token budget.
        """
        items = list(items)
        keys = self.keys_of(items)
        if self.group is None:
            index_batches = self.index_batches(keys)
        else:
            index_batches = self.grouped_index_batches(keys, self.groups_of(items))
        for idx in index_batches:
            yield Batch((items[i] for i in idx), idx)

    def sampler(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        groups: Sequence[Hashable] | np.ndarray | None = None,
    ) -> BatchSampler:
        """A batch sampler for `DataLoader(batch_sampler=...)` over a dataset's lengths.

        See [`BatchSampler`][batchkit.BatchSampler] for shuffling, epochs, sharding
        across ranks and resuming.

        Args:
            lengths: `lengths[i]` is example `i`'s key (its token count); the
                policy's `max_tokens` and `cost` apply to them.
            rank: this process's rank, in `[0, world_size)`.
            world_size: how many ranks share the batches.
            shuffle: a new random order every epoch.
            seed: the seed every rank shares.
            drop_last: drop the last batches instead of repeating some, so the
                batch count is a multiple of `world_size`.
            groups: `groups[i]` is example `i`'s group (any hashable: a task, a
                model); every batch holds at most `max_groups_per_batch` groups (1 for
                a policy without `group`). The policy's `group` function is not used
                (the sampler sees lengths, not items). None: no groups.

        Raises:
            ValueError: the policy has `group` but no `groups` are given (its batches
                would mix groups), or `groups` and `lengths` differ in length.
        """
        if groups is None and self.group is not None:
            raise ValueError(
                "this policy has group=, but a sampler sees lengths, not items: pass "
                "groups= (one group per length) to keep its batches within "
                f"max_groups_per_batch={self.max_groups_per_batch}"
            )
        return BatchSampler(
            self,
            lengths,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            groups=groups,
        )

    def stream(
        self,
        items: Iterable[T],
        *,
        buffer_size: int = 10_000,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        sync_buckets: bool = False,
        drop_last: bool = False,
    ) -> Iterator[Batch[T]]:
        """Batches of an iterable too large to hold, read lazily into a bounded buffer.

        The buffer is filled with up to `buffer_size` items, shuffled under `seed`,
        cut into batches by this policy's rules (as
        [`batches`][batchkit.Batcher.batches] would cut it) and handed out in steps
        of one batch per rank; batches that do not fill a step wait for the next
        fill. Every rank reads the whole stream, runs the same steps and keeps batch
        `rank` of each, so all ranks get the same number of batches and each item
        goes to one rank. At the end the last steps are evened out like a sampler's
        (`drop_last`). Inside a `DataLoader` with workers, give each worker its own
        shard: `rank=rank * num_workers + worker_id`, `world_size=world_size *
        num_workers` (see the guide). With `group`, each fill is batched as
        [`batches`][batchkit.Batcher.batches] batches it, so every batch holds at
        most `max_groups_per_batch` groups (a step's batches may differ in group).

        Args:
            items: any iterable (read once, one item at a time).
            buffer_size: the most items held at once, read but not yet handed out.
            seed: the seed every rank shares (use `seed + epoch` for a new order).
            rank: this process's (or worker's) shard, in `[0, world_size)`.
            world_size: how many shards share the stream.
            shuffle: shuffle within each fill of the buffer, and the order of steps.
            sync_buckets: every step's batches come from one bucket (`bucket_of`),
                so no rank waits for a longer bucket than the others' (a no-op for a
                policy without buckets).
            drop_last: at the end, drop the batches that do not fill a step instead
                of repeating some.

        Returns:
            An iterator of this rank's [`Batch`][batchkit.Batch]es; their `indices`
            are the items' positions in the stream. Nothing is read before the
            first batch is asked for.

        Raises:
            ValueError: `buffer_size` or `world_size` below 1, a `rank` outside
                `[0, world_size)`, or a negative `seed`; when the batches are read, a
                bad key (as in [`batches`][batchkit.Batcher.batches]).
            TypeError: when the batches are read, a key that is not a number or a
                group that is not hashable, named by its position in the stream.
        """
        buffer_size = positive_count("buffer_size", buffer_size)
        check_rank(rank, world_size)
        batches = stream_batches(
            self,
            items,
            buffer_size=buffer_size,
            seed=check_non_negative_int("seed", seed),
            rank=rank,
            world_size=world_size,
            shuffle=bool(shuffle),
            sync_buckets=bool(sync_buckets),
            drop_last=bool(drop_last),
        )
        return (Batch(batch, indices) for batch, indices in batches)

    def __repr__(self) -> str:
        shown = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        if self.group is None:  # an ungrouped policy reads as it did before group= existed
            shown.pop("group", None)
            shown.pop("max_groups_per_batch", None)
        opts = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"{type(self).__name__}({opts})"


def _each_item(fn: Callable[[Any], R], items: Sequence[Any], what: str, name: str) -> list[R]:
    """`fn` of every item; a TypeError or ValueError is raised again naming the item's
    position (`items[3]: ...`), a `SystemExit` or `KeyboardInterrupt` as a
    `BatchInterrupted` naming `name` (see `batchkit.usercode.contained`), any other
    exception keeps its type and gets a note."""
    out: list[R] = []
    append = out.append
    i = 0
    try:
        for i, item in enumerate(items):  # noqa: B007 - i names the failing item
            append(fn(item))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"items[{i}]: {exc}") from exc
    except BaseException as exc:
        # A SystemExit from `key` must not end the caller's loop: see batchkit.usercode.
        error = contained(exc, name, f"the {what} of items[{i}]")
        if error is exc and hasattr(exc, "add_note"):  # 3.11+: keep the user's type
            exc.add_note(f"(while computing the {what} of items[{i}])")
        raise error  # noqa: B904 - a new error has its cause set
    return out
