"""Grouped batching online: every batch within its group limit, the oldest group first,
and each caller's own result, from threads and asyncio."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import DynamicBatcher
from batchkit.serve.buckets import Bucket
from batchkit.serve.request import Request, new_request
from batchkit.serve.scheduler import Scheduler, group_bucket
from tests.serve._passes import admit, poll


def by_task(item: tuple[Hashable, int]) -> Hashable:
    return item[0]


def add(sched: Scheduler, item: tuple[Hashable, int], now: float, priority: int = 0) -> Request:
    policy = sched.policy
    key = policy.key_of(item)
    group = policy.group_of(item)
    req = new_request(item, key, group_bucket(policy, key, group), priority, None, None, now, group)
    admit(sched, req)
    return req


def groups_of(batch: list[tuple[Hashable, int]]) -> set[Hashable]:
    return {task for task, _ in batch}


# -- the scheduler, on explicit times -----------------------------------------------
def test_a_batch_takes_one_group_and_the_oldest_group_goes_first() -> None:
    sched = Scheduler(DynamicBatcher(8, 5, group=by_task), max_concurrent_batches=1)
    add(sched, ("b", 0), 0.0)
    first, _ = poll(sched, 0.0)  # idle: b leaves alone
    assert first is not None
    for i, task in enumerate("aabab"):
        add(sched, (task, i), 0.001 * i)
    sched.finish(first, 0.010)
    batch, _ = poll(sched, 0.010)
    assert batch is not None and [r.item for r in batch.requests] == [("a", 0), ("a", 1), ("a", 3)]
    sched.finish(batch, 0.011)
    batch, _ = poll(sched, 0.011)
    assert batch is not None and [r.item for r in batch.requests] == [("b", 2), ("b", 4)]


def test_priorities_outrank_the_age_of_a_group() -> None:
    sched = Scheduler(DynamicBatcher(8, 5, group=by_task))
    add(sched, ("a", 0), 0.0)
    add(sched, ("b", 1), 0.001, priority=-1)
    batch, _ = poll(sched, 0.002)
    assert batch is not None and [r.item for r in batch.requests] == [("b", 1)]


def test_a_short_batch_is_filled_from_the_next_oldest_groups_up_to_the_limit() -> None:
    sched = Scheduler(DynamicBatcher(8, 5, group=by_task, max_groups_per_batch=2))
    for i, task in enumerate("abcab"):
        add(sched, (task, i), 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None
    assert [r.item for r in batch.requests] == [("a", 0), ("a", 3), ("b", 1), ("b", 4)]
    sched.finish(batch, 0.001)
    batch, _ = poll(sched, 0.001)
    assert batch is not None and [r.item for r in batch.requests] == [("c", 2)]
    assert sched.num_waiting == 0


def test_a_cold_group_behind_a_hot_one_waits_its_max_wait_plus_the_running_batch() -> None:
    """0.9x load of a hot group (full batches of 4 in 2 ms) and one cold request: the
    cold one leaves within max_wait plus the batches running when it became due."""
    wait_s, batch_s = 0.005, 0.002
    sched = Scheduler(DynamicBatcher(4, wait_s * 1e3, group=by_task))
    hot_interval = batch_s / 4 / 0.9
    arrivals = [(round(i * hot_interval, 6), ("hot", i)) for i in range(400)]
    cold_at = 0.1003
    arrivals.append((cold_at, ("cold", 0)))
    arrivals.sort()
    now, running, ends, cold_left = 0.0, None, 0.0, None
    step = 0.0001
    while arrivals or sched.num_waiting or running is not None:
        while arrivals and arrivals[0][0] <= now + 1e-12:
            at, item = arrivals.pop(0)
            add(sched, item, at)
        if running is not None and now >= ends - 1e-12:
            sched.finish(running, now)
            running = None
        if running is None:
            running, _ = poll(sched, now)
            if running is not None:
                ends = now + batch_s
                if any(r.item[0] == "cold" for r in running.requests):
                    cold_left = now
        now = round(now + step, 6)
    assert cold_left is not None
    assert cold_left - cold_at <= wait_s + 2 * batch_s + step


def test_groups_that_come_and_go_leave_no_bucket_behind() -> None:
    # One group per caller (a user id, say), each seen once or twice: a pass over the
    # buckets must not walk every group ever seen, nor their memory stay.
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=1000, group=by_task))
    now = 0.0
    for user in range(500):
        reqs = [add(sched, (user, k), now) for k in range(2)]
        batch, _ = poll(sched, now)
        assert batch is not None and batch.requests == reqs
        now += 0.01
        sched.finish(batch, now)
    late = add(sched, ("late", 0), now)
    batch, _ = poll(sched, now)
    assert batch is not None and batch.requests == [late]
    assert len(sched.waiting.buckets) <= 2


@pytest.mark.filterwarnings("ignore:more than .* groups")
@pytest.mark.parametrize("groups", [500, 4000])
def test_many_groups_waiting_at_once_cost_each_pass_a_few_bucket_reads(
    groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One request per group, all waiting at once, served one batch at a time. A pass
    # that asked every waiting group's bucket made the whole run quadratic: 8,000
    # groups took 36 s. Now each pass reads a few buckets, however many groups wait.
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=1000, group=by_task))
    reqs = [add(sched, (g, 0), 0.0) for g in range(groups)]
    reads = 0
    head = Bucket.head

    def counted(bucket: Bucket) -> Request | None:
        nonlocal reads
        reads += 1
        return head(bucket)

    monkeypatch.setattr(Bucket, "head", counted)
    served = []
    now = 0.0
    while sched.num_waiting:
        batch, _ = poll(sched, now)
        assert batch is not None
        served += batch.requests
        now += 0.001
        sched.finish(batch, now)
    assert served == reqs  # the oldest group first, each alone
    assert reads <= 4 * groups


def test_group_stats_count_each_groups_requests_batches_and_waits() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1, group=by_task)
    def f(items: list[tuple[str, int]]) -> list[int]:
        return [v for _, v in items]

    assert f.map([("a", 1), ("b", 2), ("a", 3)]) == [1, 2, 3]
    groups = f.stats().groups
    assert set(groups) == {"a", "b"}
    assert groups["a"].requests == 2 and groups["b"].requests == 1
    assert groups["a"].batches >= 1 and groups["b"].batches >= 1
    assert groups["a"].queue_wait.count == 2
    f.close()


def test_without_group_nothing_is_grouped_and_no_group_stats() -> None:
    @batchkit.batched(max_batch_size=4)
    def f(items: list[int]) -> list[int]:
        return items

    assert f.map([1, 2]) == [1, 2]
    assert f.stats().groups == {}
    f.close()


# -- errors: only the caller whose item is bad ---------------------------------------
def test_a_failing_or_unhashable_group_fails_only_its_own_caller() -> None:
    def group(item: Any) -> Any:
        if item == "boom":
            raise KeyError("no adapter")
        return [1] if item == "list" else item[0]

    @batchkit.batched(max_batch_size=4, group=group)
    def f(items: list[Any]) -> list[Any]:
        return items

    with pytest.raises(KeyError, match="no adapter"):
        f("boom")
    with pytest.raises(TypeError, match="hashable"):
        f("list")
    assert f(("a", 1)) == ("a", 1)
    f.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_max_groups_per_batch_must_be_a_whole_number_of_at_least_one(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_groups_per_batch"):
        batchkit.batched(group=by_task, max_groups_per_batch=bad)


def test_group_beside_a_batcher_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="group"):
        batchkit.batched(batcher=DynamicBatcher(4, 1), group=by_task)


def test_max_groups_per_batch_without_group_is_refused() -> None:
    with pytest.raises(ValueError, match="group"):
        batchkit.batched(max_groups_per_batch=2)


def test_configure_keeps_the_grouping() -> None:
    seen: list[set[Hashable]] = []

    @batchkit.batched(max_batch_size=2, max_wait_ms=50, group=by_task)
    def f(items: list[tuple[str, int]]) -> list[int]:
        seen.append(groups_of(items))
        return [v for _, v in items]

    f.configure(max_batch_size=8, max_wait_ms=1)
    assert f.map([("a", 1), ("b", 2), ("a", 3), ("b", 4)]) == [1, 2, 3, 4]
    assert all(len(g) == 1 for g in seen)
    f.close()


def test_a_stream_of_a_grouped_function_batches_by_group() -> None:
    seen: list[set[Hashable]] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=5, group=by_task)
    def f(items: list[tuple[str, int]]) -> Any:
        seen.append(groups_of(items))
        yield [v for _, v in items]
        yield [v * 10 for _, v in items]

    streams = [f.stream((t, i)) for i, t in enumerate("abab")]
    assert [list(s) for s in streams] == [[0, 0], [1, 10], [2, 20], [3, 30]]
    assert all(len(g) == 1 for g in seen)
    f.close()


def test_a_latency_target_serves_every_group() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1, group=by_task, max_latency_ms=10_000)
    def f(items: list[tuple[str, int]]) -> list[int]:
        return [v for _, v in items]

    items = [(t, i) for i, t in enumerate("abcabc" * 3)]
    assert f.map(items) == [v for _, v in items]
    assert f.stats().latency_model is not None
    f.close()


# -- properties: threads and asyncio ---------------------------------------------------
grouped_calls = st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 1)), min_size=1, max_size=40)


@settings(max_examples=15, deadline=None)
@given(calls=grouped_calls, limit=st.integers(1, 3), size=st.integers(1, 6))
def test_threads_every_batch_within_its_group_limit_and_each_caller_its_result(
    calls: list[tuple[int, int]], limit: int, size: int
) -> None:
    batches: list[list[tuple[int, int]]] = []
    lock = threading.Lock()

    @batchkit.batched(max_batch_size=size, max_wait_ms=1, group=by_task, max_groups_per_batch=limit)
    def f(items: list[tuple[int, int]]) -> list[tuple[int, int]]:
        with lock:
            batches.append(list(items))
        return [(g, i * 2) for g, i in items]

    items = [(g, i) for i, (g, _) in enumerate(calls)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(f, item, priority=p) for item, (_, p) in zip(items, calls)]
        results = [fut.result(timeout=30) for fut in futures]
    f.close()
    assert results == [(g, i * 2) for g, i in items]
    assert all(len(groups_of(b)) <= limit and len(b) <= size for b in batches)
    ran = sorted(item for b in batches for item in b)
    assert ran == sorted(items)  # every item ran once: none lost, none twice


@settings(max_examples=15, deadline=None)
@given(
    calls=grouped_calls,
    limit=st.integers(1, 3),
    cancelled=st.sets(st.integers(0, 39)),
)
def test_asyncio_groups_with_cancellation_lose_and_duplicate_nothing(
    calls: list[tuple[int, int]], limit: int, cancelled: set[int]
) -> None:
    batches: list[list[tuple[int, int]]] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=1, group=by_task, max_groups_per_batch=limit)
    async def f(items: list[tuple[int, int]]) -> list[int]:
        batches.append(list(items))
        await asyncio.sleep(0)
        return [i for _, i in items]

    items = [(g, i) for i, (g, _) in enumerate(calls)]

    async def main() -> list[Any]:
        tasks = [
            asyncio.ensure_future(f.acall(item, priority=p)) for item, (_, p) in zip(items, calls)
        ]
        await asyncio.sleep(0)
        for i in cancelled:
            if i < len(tasks):
                tasks[i].cancel()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await f.aclose()
        return out

    results = asyncio.run(main())
    ran = [item for b in batches for item in b]
    assert len(ran) == len(set(ran))  # none twice
    for item, result in zip(items, results):
        if isinstance(result, asyncio.CancelledError):
            continue  # withdrawn, or cancelled while its batch ran
        assert result == item[1]
        assert item in ran
    assert all(len(groups_of(b)) <= limit for b in batches)


def test_group_stats_keep_the_most_recent_groups_and_warn_once() -> None:
    from batchkit.serve.stats import GROUPS_KEPT

    sched = Scheduler(DynamicBatcher(4, max_wait_ms=1000, group=by_task))
    with pytest.warns(RuntimeWarning, match=f"more than {GROUPS_KEPT} groups") as warned:
        for g in range(GROUPS_KEPT + 10):
            add(sched, (g, 0), 0.0)
    assert len(warned) == 1
    groups = sched.stats.groups
    assert len(groups) == GROUPS_KEPT and set(groups) == set(range(10, GROUPS_KEPT + 10))
    batch, _ = poll(sched, 0.0)  # the oldest groups' requests, though forgotten: counted again
    assert batch is not None and len(sched.stats.groups) == GROUPS_KEPT


def test_raise_priority_puts_another_groups_request_first() -> None:
    sched = Scheduler(DynamicBatcher(1, max_wait_ms=0, group=by_task))
    first = add(sched, ("x", 1), 0.0, priority=1)
    later = add(sched, ("y", 1), 0.0, priority=1)
    sched.waiting.raise_priority(later, 0)
    served = []
    for _ in range(2):
        batch, _ = poll(sched, 0.0)
        assert batch is not None
        served += batch.requests
        sched.finish(batch, 0.0)
    assert served == [later, first]
