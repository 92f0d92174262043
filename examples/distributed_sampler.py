"""Data-parallel batch samplers: 4 simulated ranks, coverage and padding waste.

``policy.sampler(lengths, rank=r, world_size=4, seed=0)`` is built once per rank,
as each DDP process would build it. The script checks what every rank relies on:
the ranks yield the same number of batches (no rank hangs on a collective), each
epoch covers the dataset (every example at least once with ``drop_last=False``,
never twice with ``drop_last=True``), and a sampler resumed from a checkpoint
yields exactly the batches the run had left. It prints the coverage and the padding
waste (padded slots holding no token) of static, sorted and bucketed batches, the
buckets fixed at powers of two or estimated from the lengths
(``BucketedBatcher.from_lengths``). numpy only; about two seconds:

    python examples/distributed_sampler.py
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import batchkit
from batchkit.batchers import Batcher

WORLD_SIZE = 4


def simulate(policy: Batcher, lengths: list[int], drop_last: bool) -> list[list[list[int]]]:
    """One epoch as each rank sees it (rank ``r`` gets ``result[r]``)."""
    ranks = []
    for rank in range(WORLD_SIZE):
        sampler = policy.sampler(lengths, rank=rank, world_size=WORLD_SIZE, drop_last=drop_last)
        sampler.set_epoch(1)  # as a training loop does before every epoch
        ranks.append(list(sampler))
    return ranks


def report(name: str, policy: Batcher, lengths: list[int]) -> None:
    """Check coverage for both drop_last settings; print coverage and padding waste."""
    for drop_last in (False, True):
        ranks = simulate(policy, lengths, drop_last)
        per_rank = {len(r) for r in ranks}
        assert len(per_rank) == 1, "every rank yields the same number of batches"
        seen = Counter(i for r in ranks for b in r for i in b)
        if drop_last:
            assert max(seen.values()) == 1, "no example twice across ranks"
        else:
            assert len(seen) == len(lengths), "every example at least once"
        real = slots = 0
        for batch in (b for r in ranks for b in r):
            keys = [lengths[i] for i in batch]
            real, slots = real + sum(keys), slots + len(keys) * max(keys)
        repeats = sum(seen.values()) - len(seen)
        print(
            f"{name:<28} drop_last={drop_last!s:<5}  {per_rank.pop():4d} batches/rank  "
            f"covered {len(seen) / len(lengths):7.2%}  repeated {repeats:3d}  "
            f"padding waste {1 - real / slots:6.1%}"
        )


def check_resume(policy: Batcher, lengths: list[int]) -> None:
    """Stop rank 0 after 5 batches, checkpoint, resume rank 3 in a fresh sampler."""
    sampler = policy.sampler(lengths, rank=0, world_size=WORLD_SIZE)
    sampler.set_epoch(2)
    batches = iter(sampler)
    for _ in range(5):
        next(batches)
    state = sampler.state_dict()  # {"epoch": 2, "batches_yielded": 5, ...}

    full = policy.sampler(lengths, rank=3, world_size=WORLD_SIZE)
    full.set_epoch(2)
    resumed = policy.sampler(lengths, rank=3, world_size=WORLD_SIZE)  # after a restart
    resumed.load_state_dict(state)  # all ranks step together: rank 0's state fits all
    resumed.set_epoch(2)
    assert list(resumed) == list(full)[5:]
    print(f"resumed at {state}: the remaining {len(full) - 5} batches match")


def main() -> None:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(4.0, 1.0, 20_000).round()).astype(int).tolist()
    powers = [2**k for k in range(3, 14) if 2 ** (k - 1) < max(lengths)]
    estimated = batchkit.BucketedBatcher.from_lengths(
        lengths, num_buckets=len(powers), max_batch_size=32
    )
    print(f"{len(lengths)} examples, lengths {min(lengths)}-{max(lengths)} (lognormal)")
    print(f"power-of-two boundaries: {powers}")
    print(f"estimated boundaries:    {list(estimated.boundaries)}\n")
    policies: dict[str, Batcher] = {
        "StaticBatcher(32)": batchkit.StaticBatcher(32),
        "SortedBatcher(window=2048)": batchkit.SortedBatcher(batch_size=32, window=2048),
        "Bucketed, powers of two": batchkit.BucketedBatcher(powers, max_batch_size=32),
        "Bucketed, from_lengths": estimated,
        "Bucketed, + max_tokens=4096": batchkit.BucketedBatcher.from_lengths(
            lengths, num_buckets=len(powers), max_batch_size=128, max_tokens=4096
        ),
    }
    for name, policy in policies.items():
        report(name, policy, lengths)
    print()
    check_resume(estimated, lengths)


if __name__ == "__main__":
    main()
