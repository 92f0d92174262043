"""The scheduler core, driven with explicit times: deterministic, no threads, no sleeps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, DynamicBatcher, QueueFull, SortedBatcher, StaticBatcher
from batchkit.batchers.base import Batcher
from batchkit.serve.request import DROPPED, RUNNING, Request, new_request
from batchkit.serve.scheduler import Scheduler
from batchkit.serve.stats import DispatchReason
from tests.batchers._costs import squares, within_budget
from tests.serve._passes import admit, poll


def add(sched: Scheduler, item: object, now: float, priority: int = 0) -> Request:
    policy = sched.policy
    key = policy.key_of(item)
    req = new_request(item, key, policy.bucket_of(key), priority)
    req.enqueued_at = now
    admit(sched, req)
    return req


def test_idle_dispatches_at_once() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=10))
    add(sched, 1, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.IDLE
    assert [r.item for r in batch.requests] == [1]


def test_busy_waits_for_max_wait_from_oldest() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=10), max_concurrent_batches=2)
    add(sched, 0, 0.0)
    first, _ = poll(sched, 0.0)  # idle -> leaves
    assert first is not None
    add(sched, 1, 1.0)
    add(sched, 2, 1.005)
    batch, wake = poll(sched, 1.005)
    assert batch is None and wake == pytest.approx(1.010)
    batch, _ = poll(sched, 1.00999)
    assert batch is None
    batch, _ = poll(sched, 1.010)
    assert batch is not None and batch.reason is DispatchReason.MAX_WAIT
    assert [r.item for r in batch.requests] == [1, 2]


def test_full_batch_leaves_while_busy() -> None:
    sched = Scheduler(DynamicBatcher(3, max_wait_ms=1000), max_concurrent_batches=2)
    add(sched, 0, 0.0)
    assert poll(sched, 0.0)[0] is not None
    for i in range(4):
        add(sched, i, 0.1)
    batch, _ = poll(sched, 0.1)
    assert batch is not None and batch.reason is DispatchReason.FULL and len(batch.requests) == 3
    assert poll(sched, 0.1) == (None, None)  # both slots busy: nothing to wake for
    sched.finish(batch, 0.2)
    batch, _ = poll(sched, 0.2)
    assert batch is None  # one still running, 1 waiting, not full, not aged


def test_no_slot_no_batch() -> None:
    sched = Scheduler(DynamicBatcher(2, max_wait_ms=0))
    add(sched, 0, 0.0)
    running, _ = poll(sched, 0.0)
    for i in range(5):
        add(sched, i, 0.0)
    assert poll(sched, 100.0) == (None, None)
    assert running is not None
    sched.finish(running, 1.0)
    batch, _ = poll(sched, 1.0)
    assert batch is not None and len(batch.requests) == 2


def test_static_waits_for_full_then_flushes_on_close() -> None:
    sched = Scheduler(StaticBatcher(3))
    add(sched, 0, 0.0)
    add(sched, 1, 0.0)
    assert poll(sched, 1e9) == (None, None)  # no timer: static never leaves partial
    sched.close()
    batch, _ = poll(sched, 1e9)
    assert batch is not None and batch.reason is DispatchReason.CLOSING
    assert len(batch.requests) == 2


def test_priority_lower_first_across_buckets() -> None:
    sched = Scheduler(BucketedBatcher([2, 10], max_batch_size=2, max_wait_ms=0))
    add(sched, "aaaaa", 0.0, priority=5)
    add(sched, "a", 0.1, priority=1)
    add(sched, "bbbbb", 0.2, priority=0)
    batch, _ = poll(sched, 1.0)
    assert batch is not None
    assert [r.item for r in batch.requests] == ["bbbbb", "aaaaa"]  # priority 0 then 5, same bucket


def test_bucket_never_mixed_and_token_budget() -> None:
    sched = Scheduler(BucketedBatcher([2, 10], max_batch_size=8, max_tokens=12, max_wait_ms=0))
    for item in ["a", "bbbb", "c", "dddd", "eeee", "ffff"]:
        add(sched, item, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None
    assert [r.item for r in batch.requests] == ["a", "c"]
    sched.finish(batch, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None
    assert [r.item for r in batch.requests] == ["bbbb", "dddd", "eeee"]  # 3*4 = 12 tokens


@pytest.mark.parametrize(
    ("cost", "lengths", "full"),
    [
        ("padded", [10, 1], True),  # 2 x 10 = 20: the budget is used
        ("sum", [10, 1], False),  # 11 of 20: more may join
        ("sum", [10, 1, 9], True),  # 20 of 20
        (squares, [3, 3], False),  # 18 of 20
        (squares, [3, 3, 1, 1], True),  # 20 of 20
    ],
    ids=["padded-full", "sum-room", "sum-full", "squares-room", "squares-full"],
)
def test_a_bucket_is_full_when_its_waiting_requests_reach_the_budget_by_cost(
    cost: object, lengths: list[int], full: bool
) -> None:
    # not eager: only a full batch (or the long max wait) leaves
    sched = Scheduler(DynamicBatcher(8, max_wait_ms=1000, max_tokens=20, cost=cost, eager=False))
    for n in lengths:
        add(sched, "x" * n, 0.1)
    batch, _ = poll(sched, 0.1)
    if full:
        assert batch is not None and batch.reason is DispatchReason.FULL
        assert within_budget(sched.policy, [r.key for r in batch.requests])
    else:
        assert batch is None


def test_a_sum_budget_batch_takes_what_a_padded_one_leaves() -> None:
    """The same waiting requests and budget: "sum" takes all three, "padded" one."""
    for cost, expected in (("padded", ["a" * 12]), ("sum", ["a" * 12, "b", "c"])):
        sched = Scheduler(DynamicBatcher(8, max_wait_ms=0, max_tokens=14, cost=cost))
        for item in ["a" * 12, "b", "c"]:
            add(sched, item, 0.0)
        batch, _ = poll(sched, 0.0)
        assert batch is not None and [r.item for r in batch.requests] == expected


def test_queue_full_rejects_without_enqueueing() -> None:
    sched = Scheduler(DynamicBatcher(2), max_queue_size=2)
    add(sched, 0, 0.0)
    add(sched, 1, 0.0)
    with pytest.raises(QueueFull, match="max_queue_size=2"):
        add(sched, 2, 0.0)
    assert sched.num_waiting == 2 and sched.stats.rejected == 1


def test_drop_removes_waiting_only() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=0))
    a = add(sched, "a", 0.0)
    b = add(sched, "b", 0.0)
    assert sched.waiting.withdraw(a)
    assert not sched.waiting.withdraw(a)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.requests == [b]
    assert not sched.waiting.withdraw(b)  # running
    assert a.state == DROPPED and b.state == RUNNING


def test_strict_sizes_pad_up() -> None:
    policy = DynamicBatcher(64, preferred_batch_sizes=[1, 4, 8], strict_sizes=True, max_wait_ms=0)
    sched = Scheduler(policy)
    for i in range(5):
        add(sched, i, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and len(batch.requests) == 5 and batch.padded_size == 8


def test_preferred_sizes_take_largest_available() -> None:
    sched = Scheduler(DynamicBatcher(64, preferred_batch_sizes=[2, 4], max_wait_ms=0))
    for i in range(7):
        add(sched, i, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and len(batch.requests) == 4 and batch.padded_size == 4


def test_sorted_groups_nearest_keys_with_oldest() -> None:
    sched = Scheduler(SortedBatcher(batch_size=3, max_wait_ms=0))
    for item in ["a" * 5, "a" * 50, "a" * 4, "a" * 49, "a" * 6, "a" * 51]:
        add(sched, item, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None
    assert sorted(len(r.item) for r in batch.requests) == [4, 5, 6]


policies = st.sampled_from(
    [
        DynamicBatcher(4, max_wait_ms=3),
        DynamicBatcher(8, max_wait_ms=0, max_tokens=20),
        DynamicBatcher(8, max_wait_ms=0, max_tokens=20, cost="sum"),
        DynamicBatcher(8, max_wait_ms=2, max_tokens=90, cost=squares),
        BucketedBatcher([3, 6], max_batch_size=3, max_wait_ms=2),
        BucketedBatcher([3, 6], max_batch_size=6, max_wait_ms=2, max_tokens=15, cost="sum"),
        SortedBatcher(batch_size=4, max_wait_ms=1),
        SortedBatcher(batch_size=6, max_wait_ms=1, max_tokens=60, cost=squares),
        SortedBatcher(batch_size=6, max_wait_ms=1, max_tokens=20, cost="sum"),
        StaticBatcher(3),
    ]
)


@given(
    policies,
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.floats(0, 5)), max_size=60),
    st.integers(1, 3),
)
def test_everything_served_once_within_limits(
    policy: Batcher, arrivals: list[tuple[int, int, float]], slots: int
) -> None:
    """Simulate arrivals and completions on a fake clock: each request runs exactly once."""
    sched = Scheduler(policy, max_concurrent_batches=slots)
    now, running, served = 0.0, [], []

    def finish_oldest() -> None:
        done = running.pop(0)
        reqs = done.requests
        assert all(r.state == RUNNING for r in reqs)
        assert 1 <= len(reqs) <= policy.max_batch_size
        assert within_budget(policy, [r.key for r in reqs])
        assert len({r.bucket for r in reqs}) == 1
        sched.finish(done, now)
        served.extend(reqs)

    added = []
    for length, priority, gap in arrivals:
        now += gap / 1000
        added.append(add(sched, "x" * length, now, priority))
        while (batch := poll(sched, now)[0]) is not None:
            running.append(batch)
        if running and gap > 2:  # sometimes a batch finishes
            finish_oldest()
    sched.close()
    while running or sched.num_waiting:
        while (batch := poll(sched, now)[0]) is not None:
            running.append(batch)
        finish_oldest()
    assert sorted(map(id, served)) == sorted(map(id, added))  # each once, none lost
    assert sorted(r.seq for r in served) == list(range(1, len(arrivals) + 1))
    assert sched.drained


prefix_policies = st.sampled_from(
    [
        DynamicBatcher(4, max_wait_ms=1),
        DynamicBatcher(8, max_wait_ms=0, max_tokens=20),
        DynamicBatcher(8, max_wait_ms=0, max_tokens=20, cost="sum"),
        DynamicBatcher(8, max_wait_ms=1, max_tokens=90, cost=squares),
        BucketedBatcher([3, 6], max_batch_size=3, max_wait_ms=2),
    ]
)


@given(
    prefix_policies,
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "add", "drop", "poll", "finish"]),
            st.integers(0, 9),  # length, or which request to drop
            st.integers(0, 2),  # priority
        ),
        max_size=80,
    ),
)
def test_batches_are_the_service_order_heads_with_drops(
    policy: Batcher, ops: list[tuple[str, int, int]]
) -> None:
    """Against a reference model: every batch is the head of its bucket's waiting
    requests in (priority, arrival) order, whatever was dropped in between; dropped
    requests never run; everything else runs exactly once."""
    sched = Scheduler(policy, max_concurrent_batches=2)
    now, running, added, served = 0.0, [], [], []
    waiting: list[Request] = []  # the model: requests not yet taken or dropped
    order: dict[int, int] = {}  # the model's own arrival numbers

    def run_ready() -> None:
        while (batch := poll(sched, now)[0]) is not None:
            bucket = batch.requests[0].bucket
            expected = sorted(
                (r for r in waiting if r.bucket == bucket),
                key=lambda r: (r.priority, order[id(r)]),
            )[: len(batch.requests)]
            assert batch.requests == expected
            for r in batch.requests:
                waiting.remove(r)
            running.append(batch)

    for op, n, priority in ops:
        now += 0.0005
        if op == "add":
            waiting.append(add(sched, "x" * n, now, priority))
            added.append(waiting[-1])
            order[id(added[-1])] = len(added)
            assert sched.num_waiting == len(waiting)
        elif op == "drop" and added:
            req = added[n % len(added)]
            assert sched.waiting.withdraw(req) == (req in waiting)
            if req in waiting:
                waiting.remove(req)
        elif op == "poll":
            run_ready()
        elif op == "finish" and running:
            batch = running.pop(0)
            sched.finish(batch, now)
            served.extend(batch.requests)
    sched.close()
    while running or sched.num_waiting:
        run_ready()
        batch = running.pop(0)
        sched.finish(batch, now)
        served.extend(batch.requests)
    assert not waiting
    assert sorted(map(id, served)) == sorted(id(r) for r in added if r.state != DROPPED)
    assert len(served) == len(set(map(id, served)))
    assert sched.stats.requests == len(added)


def test_a_batch_that_is_not_the_queue_front_leaves_the_others_waiting() -> None:
    """A sorted policy picks by key, not by arrival: only the chosen requests leave
    the deque (the clean-queue shortcut pops the front only for a front batch)."""
    sched = Scheduler(SortedBatcher(batch_size=2, max_wait_ms=1))
    for item in ["aaaaa", "a", "aaaaaa", "aa"]:
        add(sched, item, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and [r.item for r in batch.requests] == ["aaaaa", "aaaaaa"]
    sched.finish(batch, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and sorted(r.item for r in batch.requests) == ["a", "aa"]
    sched.finish(batch, 0.0)
    assert sched.drained


def test_the_public_scheduler_accepts_a_request_without_an_arrival_time() -> None:
    from batchkit.serve.scheduler import Scheduler

    sched = Scheduler(DynamicBatcher(4, max_wait_ms=10))
    admit(sched, new_request("x", 0.0, None, 0))
    batch, _ = poll(sched, 0.0)
    assert batch is not None and [r.item for r in batch.requests] == ["x"]


def test_a_select_that_reorders_its_list_still_takes_what_it_chose() -> None:
    from batchkit.serve.scheduler import Scheduler

    class ShortestFirst(DynamicBatcher):
        candidate_limit = None

        def select(self, candidates):
            candidates.sort(key=lambda r: r.key)  # in place
            return candidates[:2]

    sched = Scheduler(ShortestFirst(max_batch_size=2, max_wait_ms=0, key=len))
    for item in ["ccc", "a", "bb"]:
        admit(sched, new_request(item, float(len(item)), None, 0))
    served = []
    while True:
        batch, _ = poll(sched, 0.0)
        if batch is None:
            break
        served += [r.item for r in batch.requests]
        sched.finish(batch, 0.0)
    assert served == ["a", "bb", "ccc"]  # was ['a', 'bb', 'bb']: ccc lost, bb run twice


def test_a_select_replaced_on_the_policy_instance_is_not_taken_for_a_prefix() -> None:
    """The queue-front shortcut trusts only the built-in select methods; one replaced on
    the instance (a mock, a monkeypatch) that is not a prefix used to pop the wrong
    entries: request 2 ran three times, 0 and 1 were lost."""
    from batchkit.batchers.dynamic import DynamicBatcher

    policy = DynamicBatcher(max_batch_size=4, max_wait_ms=1000)
    policy.select = lambda cands: [cands[-1]]  # type: ignore[method-assign]
    sched = Scheduler(policy)
    for i in range(3):
        admit(sched, new_request(i, 0.0, None, 0))
    served = []
    while (batch := poll(sched, 0.0)[0]) is not None:
        served += [r.item for r in batch.requests]
        sched.finish(batch, 0.0)
    assert served == [2, 1, 0]


def test_a_keyless_policy_in_several_buckets_serves_the_oldest_head_first() -> None:
    """Scheduler users (simulate(keys=...)) may bucket a keyless policy's requests: the
    arrival order must still break ties between buckets."""
    from batchkit.batchers.bucketed import BucketedBatcher

    policy = BucketedBatcher([4, 8], key=None, max_batch_size=1, max_wait_ms=0)
    sched = Scheduler(policy)

    def add(item: str, key: float) -> None:
        admit(sched, new_request(item, key, policy.bucket_of(key), 0))

    add("first-short", 2.0)  # makes bucket 0 the first in dict order
    batch, _ = poll(sched, 0.0)
    assert batch is not None
    sched.finish(batch, 0.0)
    add("older-long", 6.0)
    add("newer-short", 2.0)
    sched.close()
    batch, _ = poll(sched, 0.0)
    assert batch is not None and [r.item for r in batch.requests] == ["older-long"]


class _PicksNothing(DynamicBatcher):
    def select(self, candidates):  # type: ignore[no-untyped-def]
        return []


def test_a_policy_whose_select_picks_nothing_is_an_error_not_a_stall() -> None:
    sched = Scheduler(_PicksNothing(4))
    add(sched, 1, 0.0)
    with pytest.raises(ValueError, match=r"_PicksNothing.select\(\) chose no request of the 1"):
        poll(sched, 0.0)


class _RaisesOnBigBatches(DynamicBatcher):
    def select(self, candidates):  # type: ignore[no-untyped-def]
        if len(candidates) > 2:
            raise RuntimeError("a bug in select")
        return super().select(candidates)


def test_decide_returns_a_failing_selection_s_candidates_with_its_error() -> None:
    sched = Scheduler(_RaisesOnBigBatches(4, max_wait_ms=10))
    first = [add(sched, i, 0.0) for i in range(3)]
    batch, wake_at, dropped = sched.decide(0.0)
    assert batch is None and wake_at == 0.0  # look again at once
    assert list(dropped) == first
    assert all(r.state == DROPPED and str(r.error) == "a bug in select" for r in first)
    assert sched.stats.failed == 3 and sched.num_waiting == 0
    later = add(sched, 9, 0.001)  # the others go on: the next batch forms
    batch, _, dropped = sched.decide(0.001)
    assert batch is not None and batch.requests == [later] and not dropped


def test_close_sends_what_waits_at_once_and_a_closed_scheduler_stays_closed() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=1000), max_concurrent_batches=2)
    add(sched, 0, 0.0)
    assert poll(sched, 0.0)[0] is not None  # idle: leaves
    add(sched, 1, 0.0)
    assert poll(sched, 0.0)[0] is None  # waits for its max wait
    sched.close()
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.CLOSING
    assert sched.closing
    with pytest.raises(AttributeError):
        sched.closing = False  # type: ignore[misc]


def test_raise_priority_serves_a_waiting_request_sooner_in_arrival_order() -> None:
    sched = Scheduler(DynamicBatcher(1, max_wait_ms=0))
    a, b, c = (add(sched, x, 0.0, priority=p) for x, p in (("a", 0), ("b", 5), ("c", 0)))
    sched.waiting.raise_priority(b, 0)  # among the priority-0 requests, by arrival: a, b, c
    sched.waiting.raise_priority(c, 3)  # not more urgent: nothing changes
    order = []
    for _ in range(3):
        batch, _ = poll(sched, 0.0)
        assert batch is not None
        order.append(batch.requests[0].item)
        sched.finish(batch, 0.0)
    assert order == ["a", "b", "c"]
    assert (b.priority, c.priority) == (0, 0)
    sched.waiting.raise_priority(a, -1)  # no longer waiting: nothing changes
    assert a.priority == 0 and sched.num_waiting == 0
