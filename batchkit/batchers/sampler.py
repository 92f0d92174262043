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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from batchkit.batchers.checks import check_positive_int


class IndexBatching(Protocol):
    """What a sampler needs from a policy (every `Batcher` has it): the batches of
    positions in a list of keys, cut by the policy's rules."""

    def index_batches(self, keys: Sequence[float], *, shuffled: bool = False) -> list[list[int]]:
        """Batches of positions in `keys`.

        Args:
            keys: every index's key (length).
            shuffled: the keys come in a random order.
        """
        ...


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
        return [int(n) for n in lengths.tolist()]
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


def _check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


class BatchSampler:
    """Batches of dataset indices cut by a policy, reshuffled per epoch, split across ranks.

    Each epoch (see [`set_epoch`][batchkit.BatchSampler.set_epoch]) the sampler:

    1. with `shuffle`, permutes the indices from `seed` and the epoch, so the
       policy meets them in a new random order (`BucketedBatcher` keeps that order
       within each bucket, `SortedBatcher` sorts it, so equal lengths are tied
       randomly, `StaticBatcher` cuts it as it is);
    2. cuts batches by the policy's own rules (`max_batch_size` / `batch_size`,
       `max_tokens` over `lengths` by the policy's `cost`, bucket boundaries;
       `lengths[i]` is the key of index `i`, the policy's `key` function is not used);
    3. with `shuffle`, shuffles the batch order;
    4. makes the batch count a multiple of `world_size`, by repeating batches from
       the start (`drop_last=False`: every index at least once, fewer than
       `world_size` batches repeated) or dropping the last ones (`drop_last=True`:
       no index twice across ranks), and gives batch `i` to rank `i % world_size`.

    Every rank must be given the same `lengths`, policy, `seed` and epoch.

    Args:
        policy: the batching policy (any [`Batcher`][batchkit.Batcher]).
        lengths: `lengths[i]` is dataset index `i`'s key (its token count).
        rank: this process's rank, in `[0, world_size)`.
        world_size: how many ranks share the batches.
        shuffle: a new random order every epoch (else the input order).
        seed: the seed every rank shares (an int >= 0).
        drop_last: make the batch count a multiple of `world_size` by dropping the
            last batches (no index twice) instead of repeating the first ones.

    Raises:
        ValueError: a `rank`, `world_size` or `seed` out of range, or bad `lengths`.
        TypeError: `lengths` that are not ints.
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
    ) -> None:
        check_positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        self.policy = policy
        self.lengths = check_lengths(lengths)
        self.rank = rank
        self.world_size = world_size
        self.shuffle = bool(shuffle)
        self.seed = _check_non_negative_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._resume_at = 0  # batches to skip on the next __iter__ (set by load_state_dict)
        self._yielded = 0
        # (epoch, this rank's batches, digest of every rank's batches)
        self._cache: tuple[int, list[list[int]], str] | None = None

    # -- epochs -----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to produce (as `DistributedSampler.set_epoch`).

        Another epoch than the current one starts from its first batch; the same
        epoch keeps a position loaded by
        [`load_state_dict`][batchkit.BatchSampler.load_state_dict].

        Args:
            epoch: the epoch (an int >= 0).
        """
        epoch = _check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self._resume_at, self._yielded = epoch, 0, 0

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's batches of an epoch, in order.

        Batch `i` goes to rank `i % world_size`; the list is already padded or
        truncated to a multiple of `world_size`.

        Args:
            epoch: the epoch; None: the current one.
        """
        epoch = self.epoch if epoch is None else _check_non_negative_int("epoch", epoch)
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(n).tolist() if self.shuffle else list(range(n))
        keys = [self.lengths[i] for i in perm]
        batches = [
            [perm[p] for p in batch]
            for batch in self.policy.index_batches(keys, shuffled=self.shuffle)
        ]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches)).tolist()]
        return self._even_out(batches)

    def _even_out(self, batches: list[list[int]]) -> list[list[int]]:
        """The batch list cut or padded to a multiple of `world_size`."""
        extra = len(batches) % self.world_size
        if extra == 0:
            return batches
        if self.drop_last:
            return batches[: len(batches) - extra]
        missing = self.world_size - extra
        # fewer batches than ranks: cycle through them again (each rank needs one)
        return batches + [batches[i % len(batches)] for i in range(missing)]

    def _rank_batches(self) -> list[list[int]]:
        return self._epoch_cache()[1]

    def _epoch_cache(self) -> tuple[int, list[list[int]], str]:
        if self._cache is None or self._cache[0] != self.epoch:
            batches = self.global_batches()
            h = hashlib.blake2b(digest_size=8)
            for batch in batches:
                h.update(np.asarray(batch, dtype=np.int64).tobytes())
                h.update(b"|")
            self._cache = (self.epoch, batches[self.rank :: self.world_size], h.hexdigest())
        return self._cache

    # -- the DataLoader protocol -----------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches of the current epoch (from a loaded position, if any)."""
        batches = self._rank_batches()
        # set eagerly, not in the generator: state_dict() between iter() and the
        # first next() must already see the resumed position
        self._yielded, self._resume_at = self._resume_at, 0
        return self._iterate(batches, self._yielded)

    def _iterate(self, batches: list[list[int]], start: int) -> Iterator[list[int]]:
        for batch in batches[start:]:
            self._yielded += 1  # counted before the caller holds the batch
            yield list(batch)  # a copy: the caller may mutate it, the cache stays intact

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (the same on every rank)."""
        return len(self._rank_batches())

    def batches_digest(self) -> str:
        """A digest of the current epoch's batches (all ranks'): a resume checks it, so a
        state saved for other batches (another dataset, policy, `shuffle` or
        `drop_last`) is refused instead of resuming into a different list."""
        return self._epoch_cache()[2]

    # -- checkpoints ------------------------------------------------------
    def state_dict(self) -> dict[str, int | str]:
        """The position to resume from: epoch and batches this rank has yielded.

        All ranks yield in lockstep, so one rank's state can be loaded on every rank.
        With DataLoader workers prefetching, the sampler runs ahead of the batches
        the training loop has received: store your step count as
        `batches_yielded` instead to resume at the next batch not yet trained on.
        """
        return {
            "epoch": self.epoch,
            "batches_yielded": self._yielded,
            "seed": self.seed,
            "world_size": self.world_size,
            "batches_digest": self.batches_digest(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from [`state_dict`][batchkit.BatchSampler.state_dict]: the next
        iteration skips the batches yielded.

        Args:
            state: a `state_dict()` (saved on any rank).

        Raises:
            TypeError: `state` is not a mapping.
            ValueError: it lacks a position, was saved with another seed or world
                size, or for other batches (another dataset, policy, ...).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        missing = {"epoch", "batches_yielded"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}")
        for name in ("seed", "world_size"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"state was saved with {name}={state[name]!r}, this sampler has "
                    f"{name}={getattr(self, name)!r}: the remaining batches would differ"
                )
        epoch = _check_non_negative_int("epoch", state["epoch"])
        done = _check_non_negative_int("batches_yielded", state["batches_yielded"])
        current = self.epoch
        self.epoch = epoch
        total = len(self)  # (the batch count can depend on the epoch)
        if done > total:
            self.epoch = current  # a refused state changes nothing
            raise ValueError(
                f"state has batches_yielded={done} but epoch {epoch} has only {total} "
                "batches for this rank (another dataset or policy?)"
            )
        saved = state.get("batches_digest")  # (states saved before it existed lack it)
        if saved is not None and saved != self.batches_digest():
            self.epoch = current
            raise ValueError(
                f"state was saved for other batches in epoch {epoch} (another dataset, "
                "policy, shuffle or drop_last): resuming would skip the wrong ones"
            )
        self._resume_at = self._yielded = done

    def __repr__(self) -> str:
        return (
            f"BatchSampler({self.policy!r}, {len(self.lengths)} lengths, rank={self.rank}, "
            f"world_size={self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )
