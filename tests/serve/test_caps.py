"""SizeCaps: a bucket's batch size learned after out-of-memory, probed upward again."""

from __future__ import annotations

from batchkit import DynamicBatcher
from batchkit.serve.caps import PROBE_AFTER, SizeCaps
from batchkit.serve.request import Request
from batchkit.serve.scheduler import Scheduler
from tests.serve._passes import admit, poll


def _requests(n: int) -> list[Request]:
    return [Request(i, 0.0, None, 0) for i in range(n)]


def test_no_cap_until_a_batch_runs_out_of_memory() -> None:
    caps = SizeCaps()
    policy = DynamicBatcher(8)
    assert not caps.active
    assert caps.limit(None, policy) == 8
    chosen = _requests(8)
    caps.cut(chosen, None, policy)
    assert len(chosen) == 8


def test_a_cap_is_per_bucket_and_only_ever_lowered_by_learning() -> None:
    caps, policy = SizeCaps(), DynamicBatcher(8)
    caps.learn("long", 4, policy)
    caps.learn("long", 6, policy)  # a larger size that fit does not lift the cap
    assert dict(caps.items()) == {"long": 4}
    assert caps.limit("long", policy) == 4 and caps.limit("short", policy) == 8


def test_learned_cap_is_probed_upward_and_dropped_at_the_maximum() -> None:
    caps, policy = SizeCaps(), DynamicBatcher(8)
    caps.learn(None, 4, policy)
    for _ in range(PROBE_AFTER - 1):
        caps.succeeded(None, 4, policy)
    assert caps.limit(None, policy) == 4
    caps.succeeded(None, 4, policy)
    assert caps.limit(None, policy) == 5  # a quarter more, at least one
    for _ in range(PROBE_AFTER * 8):
        caps.succeeded(None, caps.limit(None, policy), policy)
    assert not caps.active


def test_batches_below_the_cap_do_not_count_towards_a_probe() -> None:
    caps, policy = SizeCaps(), DynamicBatcher(8)
    caps.learn(None, 4, policy)
    for _ in range(PROBE_AFTER * 2):
        caps.succeeded(None, 3, policy)
    assert caps.limit(None, policy) == 4


def test_a_cap_never_lifts_a_maximum_lowered_later() -> None:
    caps = SizeCaps()
    caps.learn(None, 6, DynamicBatcher(8))
    assert caps.limit(None, DynamicBatcher(3)) == 3


def test_cut_keeps_the_padded_size_within_the_cap() -> None:
    policy = DynamicBatcher(8, preferred_batch_sizes=(1, 2, 4, 8), strict_sizes=True)
    caps = SizeCaps()
    caps.learn(None, 3, policy)  # 3 is no allowed size: batches pad to 4 > 3
    chosen = _requests(8)
    caps.cut(chosen, None, policy)
    assert [r.item for r in chosen] == [0, 1]  # the oldest, padded to 2


def test_the_scheduler_forms_batches_within_the_caps_it_is_given() -> None:
    caps, policy = SizeCaps(), DynamicBatcher(8, max_wait_ms=None)
    sched = Scheduler(policy, caps=caps)
    for req in _requests(8):
        admit(sched, req)
    caps.learn(None, 3, policy)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and [r.item for r in batch.requests] == [0, 1, 2]
