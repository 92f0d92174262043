"""The pure scheduler core, step by step: what it keeps alive."""

from __future__ import annotations

import gc
import weakref

from batchkit.generate import Scheduler, Sequence


class Prompt(list):  # type: ignore[type-arg]
    """A prompt list that can be weakly referenced (the sequence keeps it as its tokens)."""


def test_deadlines_of_started_requests_do_not_keep_their_tokens_alive() -> None:
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    alive: list[weakref.ref[Prompt]] = []
    for i in range(500):  # long timeouts, each request served before the next arrives
        prompt = Prompt([1])
        alive.append(weakref.ref(prompt))
        sched.add(Sequence(i, prompt, max_new_tokens=1, deadline=1e9))
        del prompt
        batch = sched.schedule()
        sched.update(batch, [1])
        del batch
    gc.collect()
    kept = sum(ref() is not None for ref in alive)
    assert kept <= 66  # was 500: every started request's entry held its sequence
