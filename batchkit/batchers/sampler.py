"""Batch samplers: a policy's batches of dataset indices, per epoch and per rank.

`policy.sampler(lengths, ...)` returns a [`BatchSampler`][batchkit.BatchSampler] for
`DataLoader(batch_sampler=...)`. Every rank builds the same global batch list
from `lengths`, `seed` and the epoch, then takes every `world_size`-th batch,
so the ranks agree without talking to each other and all yield the same number of
batches (no rank waits on a collective the others never reach).

torch is not imported: a `DataLoader` only needs an iterable of index lists with
`__len__`. Batches are formed in the main process, so any `num_workers` works.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from batchkit.batchers.checks import check_positive_int
from batchkit.batchers.groups import group_codes

B = TypeVar("B")  # a batch: a list of indices, or an array of them


class IndexBatching(Protocol):
    """What a sampler needs from a policy (every `Batcher` has it): an epoch's batches
    of positions in a list of keys, cut by the policy's rules, in the order ranks take
    them."""

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
        """Batches of positions in `keys`, batch `i` for rank `i % world_size`.

        Args:
            keys: every position's key (length).
            shuffled: the keys come in a random order.
            world_size: how many ranks share the batches.
            rng: the epoch's random generator; None: keep the order.
            drop_last: the batches that do not fill a step will be dropped.
            groups: every position's group; a batch keeps within the policy's group
                limit (the sampler passes it only when it has groups).
        """
        ...


def split_at(flat: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """`flat` cut into consecutive pieces of `sizes` (views, no copies).

    Args:
        flat: the concatenated batches.
        sizes: each batch's length, summing to `len(flat)`.
    """
    ends = np.cumsum(sizes).tolist()
    starts = [0, *ends[:-1]]
    # slicing: np.split costs several times more per piece
    return [flat[a:b] for a, b in zip(starts, ends)]


def even_out(batches: list[B], world_size: int, drop_last: bool) -> list[B]:
    """`batches` cut or padded to a multiple of `world_size`.

    Args:
        batches: the batches, in the order ranks take them.
        world_size: how many ranks share them.
        drop_last: drop the last batches; else repeat batches from the start.
    """
    extra = len(batches) % world_size
    if extra == 0:
        return batches
    if drop_last:
        return batches[: len(batches) - extra]
    missing = world_size - extra
    # fewer batches than ranks: cycle through them again (each rank needs one)
    return batches + [batches[i % len(batches)] for i in range(missing)]


def check_lengths(lengths: Sequence[int] | np.ndarray) -> list[int]:
    """`lengths` as a list of python ints.

    Args:
        lengths: a sequence (or 1-d integer array) of ints >= 0.

    Raises:
        TypeError: not a sequence or 1-d integer array, or an entry that is not an int.
        ValueError: a negative entry (named by its position).
    """
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(
                f"lengths must be a 1-d array of ints, got shape {lengths.shape} "
                f"dtype {lengths.dtype}"
            )
        if lengths.size and int(lengths.min()) < 0:
            i = int(np.argmin(lengths))
            raise ValueError(f"lengths must be >= 0, got lengths[{i}] = {int(lengths[i])}")
        listed: list[int] = lengths.astype(np.int64).tolist()  # python ints
        return listed
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    out = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"lengths must be ints, got lengths[{i}] = {n!r}")
        if n < 0:
            raise ValueError(f"lengths must be >= 0, got lengths[{i}] = {n}")
        out.append(int(n))
    return out


def check_non_negative_int(name: str, value: object) -> int:
    """`value` as an int, or ValueError unless it is an int >= 0.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def check_rank(rank: object, world_size: int) -> None:
    """ValueError unless `world_size` is a positive int and `rank` an int in `[0, world_size)`.

    Args:
        rank: the rank to check.
        world_size: how many ranks there are.
    """
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


class BatchSampler:
    """Batches of dataset indices cut by a policy, reshuffled per epoch, split across ranks.

    Each epoch (see [`set_epoch`][batchkit.BatchSampler.set_epoch]) the sampler:

    1. with `shuffle`, permutes the indices from `seed` and the epoch, so the
       policy meets them in a new random order (`BucketedBatcher` keeps that order
       within each bucket, `SortedBatcher` sorts it, so equal lengths are tied
       randomly, `StaticBatcher` cuts it as it is);
    2. cuts batches by the policy's own rules (`max_batch_size` / `batch_size`,
       `max_tokens` over `lengths` by the policy's `cost`, bucket boundaries;
       `lengths[i]` is the key of index `i`, the policy's `key` function is not used),
       with `groups` within pools of at most the policy's `max_groups_per_batch`
       groups (1 without `group`; see
       [`grouped_index_batches`][batchkit.Batcher.grouped_index_batches]), the
       groups in the order the shuffle first meets them;
    3. orders them for the ranks by the policy's `arrange` (with `shuffle`, a
       shuffled batch order; `PackingBatcher` balances each step's tokens);
    4. makes the batch count a multiple of `world_size`, by repeating batches from
       the start (`drop_last=False`: every index at least once, fewer than
       `world_size` batches repeated) or dropping the last ones (`drop_last=True`:
       no index twice across ranks), and gives batch `i` to rank `i % world_size`.

    Every rank must be given the same `lengths`, policy, `seed` and epoch.

    A state saved mid-epoch ([`state_dict`][batchkit.BatchSampler.state_dict]) loads
    on any number of ranks: with the same `world_size` the epoch goes on where it
    stopped; with another, the indices not yet yielded (by any rank) are batched
    again for the new ranks, in the epoch's order, so the rest of the epoch covers
    each of them (exactly once unless batches are repeated to even out), the same
    on every rank and in every run with that seed.

    Args:
        policy: the batching policy (any [`Batcher`][batchkit.Batcher]).
        lengths: `lengths[i]` is dataset index `i`'s key (its token count).
        rank: this process's rank, in `[0, world_size)`.
        world_size: how many ranks share the batches.
        shuffle: a new random order every epoch (else the input order).
        seed: the seed every rank shares (an int >= 0).
        drop_last: make the batch count a multiple of `world_size` by dropping the
            last batches (no index twice) instead of repeating the first ones.
        groups: `groups[i]` is dataset index `i`'s group (any hashable); every batch
            holds at most the policy's `max_groups_per_batch` groups (1 for a policy
            without `group`). None: no groups.

    Raises:
        ValueError: a `rank`, `world_size` or `seed` out of range, bad `lengths`, or
            `groups` of another length than `lengths`.
        TypeError: `lengths` that are not ints, or a group that is not hashable.
    """

    def __init__(
        self,
        policy: IndexBatching,
        lengths: Sequence[int] | np.ndarray,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        groups: Sequence[Hashable] | np.ndarray | None = None,
    ) -> None:
        check_rank(rank, world_size)
        self.policy = policy
        self.lengths = check_lengths(lengths)
        self._keys = np.asarray(self.lengths, dtype=np.int64)
        # each index's group as a number (first seen: 0), gathered per epoch's order
        self._groups = None if groups is None else group_codes(groups, len(self.lengths))
        self.rank = rank
        self.world_size = world_size
        self.shuffle = bool(shuffle)
        self.seed = check_non_negative_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._resume_at = 0  # batches to skip on the next __iter__ (set by load_state_dict)
        self._yielded = 0
        # A state saved on another number of ranks, loaded in this epoch: the indices it
        # had yielded are left out of this epoch's batches.
        self._resumed_from: Mapping[str, Any] | None = None
        # (epoch, resumed_from, this rank's batches, digest of every rank's batches)
        self._cache: tuple[int, Mapping[str, Any] | None, list[np.ndarray], str] | None = None

    # -- epochs -----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to produce (as `DistributedSampler.set_epoch`).

        Another epoch than the current one starts from its first batch; the same
        epoch keeps a position loaded by
        [`load_state_dict`][batchkit.BatchSampler.load_state_dict].

        Args:
            epoch: the epoch (an int >= 0).
        """
        epoch = check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self._resume_at, self._yielded = epoch, 0, 0
            self._resumed_from = None

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's batches of an epoch, in order.

        Batch `i` goes to rank `i % world_size`; the list is already padded or
        truncated to a multiple of `world_size`. For the current epoch after a state
        from another number of ranks was loaded, these are the rest of the epoch's
        batches.

        Args:
            epoch: the epoch; None: the current one.
        """
        epoch = self.epoch if epoch is None else check_non_negative_int("epoch", epoch)
        resumed = self._resumed_from if epoch == self.epoch else None
        return [b.tolist() for b in self._plan(epoch, self.world_size, resumed)]

    def _plan(
        self, epoch: int, world_size: int, resumed_from: Mapping[str, Any] | None
    ) -> list[np.ndarray]:
        """The epoch's batches for `world_size` ranks, without what `resumed_from` yielded."""
        n = len(self._keys)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if resumed_from is not None:
            # the rest, in the epoch's own order: the same on every rank, every run
            order = order[~self._yielded_mask(resumed_from)[order]]
        # passed only when there are groups: a policy's own plan() may predate them
        grouping = {} if self._groups is None else {"groups": self._groups[order].tolist()}
        batches = self.policy.plan(
            self._keys[order],
            shuffled=self.shuffle,
            world_size=world_size,
            rng=rng if self.shuffle else None,
            drop_last=self.drop_last,
            **grouping,
        )
        if batches:  # positions in `order` to dataset indices, in one gather
            sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
            batches = split_at(order[np.concatenate(batches)], sizes)
        return even_out(batches, world_size, self.drop_last)

    def _yielded_mask(self, state: Mapping[str, Any]) -> np.ndarray:
        """Which indices the ranks that saved `state` had yielded in its epoch (all of
        them, in lockstep, `batches_yielded` batches each), earlier resumes included."""
        earlier = state.get("resumed_from")
        plan = self._plan(state["epoch"], state["world_size"], earlier)
        if state.get("batches_digest") not in (None, _digest(plan)):
            raise ValueError(
                f"state was saved for other batches in epoch {state['epoch']} (another "
                "dataset, policy, shuffle or drop_last): resuming would skip the wrong ones"
            )
        mask = (
            np.zeros(len(self._keys), dtype=bool)
            if earlier is None
            else self._yielded_mask(earlier)
        )
        done = plan[: state["batches_yielded"] * state["world_size"]]
        if done:
            mask[np.concatenate(done)] = True
        return mask

    def _rank_batches(self) -> list[np.ndarray]:
        return self._epoch_cache()[2]

    def _epoch_cache(self) -> tuple[int, Mapping[str, Any] | None, list[np.ndarray], str]:
        cache = self._cache
        if cache is None or cache[0] != self.epoch or cache[1] is not self._resumed_from:
            batches = self._plan(self.epoch, self.world_size, self._resumed_from)
            cache = (
                self.epoch,
                self._resumed_from,
                batches[self.rank :: self.world_size],
                _digest(batches),
            )
            self._cache = cache
        return cache

    # -- the DataLoader protocol -----------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches of the current epoch (from a loaded position, if any)."""
        batches = self._rank_batches()
        # set eagerly, not in the generator: state_dict() between iter() and the
        # first next() must already see the resumed position
        self._yielded, self._resume_at = self._resume_at, 0
        return self._iterate(batches, self._yielded)

    def _iterate(self, batches: list[np.ndarray], start: int) -> Iterator[list[int]]:
        for batch in batches[start:]:
            self._yielded += 1  # counted before the caller holds the batch
            yield batch.tolist()  # a new list: the caller may mutate it, the cache stays intact

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (the same on every rank)."""
        return len(self._rank_batches())

    def batches_digest(self) -> str:
        """A digest of the current epoch's batches (all ranks'): a resume checks it, so a
        state saved for other batches (another dataset, policy, `shuffle` or
        `drop_last`) is refused instead of resuming into a different list."""
        return self._epoch_cache()[3]

    # -- checkpoints ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch and batches this rank has yielded.

        All ranks yield in lockstep, so one rank's state can be loaded on every rank,
        and on any number of ranks. With DataLoader workers prefetching, the sampler
        runs ahead of the batches the training loop has received: store your step
        count as `batches_yielded` instead to resume at the next batch not yet
        trained on. After a resume on another number of ranks, the state holds the
        one it resumed from (`resumed_from`): the indices yielded before it.
        """
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches_yielded": self._yielded,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples": len(self.lengths),
            "batches_digest": self.batches_digest(),
        }
        if self._resumed_from is not None:
            state["resumed_from"] = self._resumed_from
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from [`state_dict`][batchkit.BatchSampler.state_dict], saved with any
        `world_size`: the next iteration yields the rest of the epoch.

        Args:
            state: a `state_dict()` (saved on any rank).

        Raises:
            TypeError: `state` is not a mapping.
            ValueError: it lacks a position, was saved with another seed or for
                another dataset length, or for other batches (another dataset,
                policy, ...).
        """
        state = self._checked_state(state)
        resumed_from = state.get("resumed_from")
        current = self.epoch, self._resumed_from
        self.epoch = state["epoch"]
        try:
            if state["world_size"] == self.world_size:  # the same batches: skip what was yielded
                self._resumed_from = resumed_from
                total = len(self)  # (the batch count can depend on the epoch)
                if state["batches_yielded"] > total:
                    raise ValueError(
                        f"state has batches_yielded={state['batches_yielded']} but epoch "
                        f"{self.epoch} has only {total} batches for this rank (another "
                        "dataset or policy?)"
                    )
                if state.get("batches_digest") not in (None, self.batches_digest()):
                    raise ValueError(
                        f"state was saved for other batches in epoch {self.epoch} (another "
                        "dataset, policy, shuffle or drop_last): resuming would skip the "
                        "wrong ones"
                    )
                done = state["batches_yielded"]
            else:  # other ranks: the indices not yet yielded, batched again for these
                self._yielded_mask(state)  # checks the state against its own batches
                self._resumed_from, done = state, 0
        except ValueError:
            self.epoch, self._resumed_from = current  # a refused state changes nothing
            raise
        self._resume_at = self._yielded = done

    def _checked_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """`state` with its fields checked against this sampler (the ones it resumed
        from, too), `world_size` filled in for a state saved before it existed."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        missing = {"epoch", "batches_yielded"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}")
        checked = dict(state)
        for name, mine in (("seed", self.seed), ("num_samples", len(self.lengths))):
            if name in state and state[name] != mine:
                raise ValueError(
                    f"state was saved with {name}={state[name]!r}, this sampler has "
                    f"{name}={mine!r}: the remaining batches would differ"
                )
        checked["epoch"] = check_non_negative_int("epoch", state["epoch"])
        checked["batches_yielded"] = check_non_negative_int(
            "batches_yielded", state["batches_yielded"]
        )
        world_size = state.get("world_size", self.world_size)
        check_positive_int("state world_size", world_size)
        checked["world_size"] = world_size
        earlier = state.get("resumed_from")
        if earlier is not None:
            earlier = self._checked_state(earlier)
            if earlier["epoch"] != checked["epoch"]:
                raise ValueError(
                    f"state resumed from epoch {earlier['epoch']} within epoch "
                    f"{checked['epoch']}: a resume never crosses epochs"
                )
            checked["resumed_from"] = earlier
        return checked

    def __repr__(self) -> str:
        return (
            f"BatchSampler({self.policy!r}, {len(self.lengths)} lengths, rank={self.rank}, "
            f"world_size={self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )


def _digest(batches: list[np.ndarray]) -> str:
    """A digest of a batch list: its indices and where each batch ends."""
    h = hashlib.blake2b(digest_size=8)
    if batches:
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        h.update(sizes.tobytes())
        h.update(np.concatenate(batches).astype(np.int64).tobytes())
    return h.hexdigest()
