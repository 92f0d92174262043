"""The Prometheus exporter for continuous batchers: exact values after known workloads
(an injected clock that advances one second per step), names, labels, lifetime."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from batchkit.generate import ContinuousBatcher, StepBatch  # noqa: E402
from batchkit.kv import BlockAllocator  # noqa: E402
from batchkit.metrics import PrometheusMetrics  # noqa: E402
from tests.generate._toy import PagedToy, SlottedToy, solo  # noqa: E402
from tests.metrics._samples import value  # noqa: E402


class Clock:
    """Advances one second per step: the step function calls ``tick``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


def clocked_batcher(clock: Clock, **kwargs: Any) -> ContinuousBatcher:
    model = SlottedToy()

    async def step(batch: StepBatch) -> list[int | None]:
        clock.tick()
        return model(batch)

    return ContinuousBatcher(step, clock=clock, name="gen", **kwargs)


def test_latency_histograms_and_outcomes_exact(registry: Any, exporter: PrometheusMetrics) -> None:
    clock = Clock()
    b = clocked_batcher(clock, max_num_seqs=4)
    assert exporter.track(b) == "gen"

    async def main() -> list[list[int]]:
        # both submitted at t=0, before the driver runs; step k ends at t=k+1
        return await b.agenerate([[1, 2, 3], [4]], max_new_tokens=3)

    assert asyncio.run(main()) == [solo([1, 2, 3], 3), solo([4], 3)]
    lb = {"batcher": "gen"}
    assert value(registry, "generation_queue_time_seconds_count", **lb) == 2
    assert value(registry, "generation_queue_time_seconds_sum", **lb) == 0.0
    assert value(registry, "generation_time_to_first_token_seconds_count", **lb) == 2
    assert value(registry, "generation_time_to_first_token_seconds_sum", **lb) == 2.0
    assert value(registry, "generation_inter_token_latency_seconds_count", **lb) == 4
    assert value(registry, "generation_inter_token_latency_seconds_sum", **lb) == 4.0
    assert value(registry, "generation_request_latency_seconds_count", **lb) == 2
    assert value(registry, "generation_request_latency_seconds_sum", **lb) == 6.0
    assert value(registry, "generation_request_latency_seconds_bucket", le="2.5", **lb) == 0
    assert value(registry, "generation_request_latency_seconds_bucket", le="5.0", **lb) == 2
    assert value(registry, "generation_requests_total", outcome="length", **lb) == 2
    for outcome in ("stop", "cancelled", "timeout", "error"):
        assert value(registry, "generation_requests_total", outcome=outcome, **lb) == 0
    assert value(registry, "generation_tokens_generated_total", **lb) == 6
    assert value(registry, "generation_tokens_computed_total", **lb) == 4 + 2 + 2
    assert value(registry, "generation_preemptions_total", **lb) == 0
    assert value(registry, "generation_waiting_sequences", **lb) == 0
    assert value(registry, "generation_running_sequences", **lb) == 0
    # slotted mode: no KV pool, no KV series
    assert registry.get_sample_value("generation_kv_blocks_used", lb) is None


def test_cancelled_and_timed_out_requests_by_outcome(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    clock = Clock()
    b = clocked_batcher(clock, max_num_seqs=1)
    exporter.track(b, name="one-row")

    async def main() -> None:
        first = b.submit([1], max_new_tokens=3)
        late = b.submit([2], max_new_tokens=1, timeout=0.5)  # waits behind: times out at t=1
        gone = b.submit([3], max_new_tokens=1)
        assert gone.cancel()
        assert await first == solo([1], 3)
        with pytest.raises(TimeoutError):
            await late
        await b.aclose()

    asyncio.run(main())
    lb = {"batcher": "one-row"}
    got = {
        outcome: value(registry, "generation_requests_total", outcome=outcome, **lb)
        for outcome in ("stop", "length", "cancelled", "timeout", "error")
    }
    assert got == {"stop": 0, "length": 1, "cancelled": 1, "timeout": 1, "error": 0}
    assert value(registry, "generation_request_latency_seconds_sum", **lb) == 3.0 + 0.0 + 1.0
    assert value(registry, "generation_queue_time_seconds_count", **lb) == 1  # only one ran


def test_kv_gauges_and_prefix_cache_counters(registry: Any, exporter: PrometheusMetrics) -> None:
    alloc = BlockAllocator(16, 4, prefix_caching=True)
    gate, entered = threading.Event(), threading.Event()
    model = PagedToy(16, 4)

    def step(batch: StepBatch) -> list[int | None]:
        if batch.step == 1:  # hold the second step: scrape while it runs
            entered.set()
            assert gate.wait(10)
        return model(batch)

    system = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
    with ContinuousBatcher(step, max_num_seqs=1, allocator=alloc, name="paged") as b:
        exporter.track(b)
        first = b.submit(system + [1], max_new_tokens=2)
        second = b.submit(system + [2], max_new_tokens=1)
        assert entered.wait(10)
        lb = {"batcher": "paged"}
        assert value(registry, "generation_running_sequences", **lb) == 1
        assert value(registry, "generation_waiting_sequences", **lb) == 1
        assert value(registry, "generation_kv_blocks_used", **lb) == 3  # 10 tokens
        assert value(registry, "generation_kv_blocks_free", **lb) == 13
        gate.set()
        assert first.result(timeout=10) == solo(system + [1], 2)
        assert second.result(timeout=10) == solo(system + [2], 1)
    pool = alloc.stats()
    assert (pool.prefix_queries, pool.prefix_hits) == (4, 2)  # the second found both blocks
    assert value(registry, "generation_prefix_cache_lookups_total", **lb) == 4
    assert value(registry, "generation_prefix_cache_hits_total", **lb) == 2
    assert value(registry, "generation_kv_blocks_used", **lb) == 0
    assert value(registry, "generation_kv_blocks_free", **lb) == 16


def test_preemptions_are_counted(registry: Any, exporter: PrometheusMetrics) -> None:
    alloc = BlockAllocator(6, 2)
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    with ContinuousBatcher(PagedToy(6, 2), max_num_seqs=6, allocator=alloc, name="tight") as b:
        exporter.track(b)
        assert b.generate(prompts, max_new_tokens=6) == [solo(p, 6) for p in prompts]
        preemptions = b.stats().preemptions
    assert preemptions > 0
    assert value(registry, "generation_preemptions_total", batcher="tight") == preemptions


def test_track_untrack_names_and_weak_references(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    a = ContinuousBatcher(SlottedToy(), name="a")
    other = ContinuousBatcher(SlottedToy(), name="b")
    assert exporter.track(a) == "a"
    assert exporter.track(a) == "a"  # idempotent
    with pytest.raises(ValueError, match="already tracked as batcher='a'"):
        exporter.track(other, name="a")
    with pytest.raises(ValueError, match="another name"):
        exporter.track(a, name="c")
    exporter.track(other)
    assert set(exporter.tracked_batchers) == {"a", "b"}
    assert exporter.tracked == {}  # the @batched functions are another table
    exporter.untrack(a)
    assert a.generate([[1]], max_new_tokens=2) == [solo([1], 2)]  # not observed any more
    assert (
        registry.get_sample_value(
            "generation_requests_total", {"batcher": "a", "outcome": "length"}
        )
        is None
    )
    assert registry.get_sample_value("generation_running_sequences", {"batcher": "a"}) is None
    with pytest.raises(KeyError):
        exporter.untrack(a)
    a.close()
    other.close()
    del other
    gc.collect()
    text = exporter.generate_latest().decode()  # a scrape forgets collected batchers
    assert 'batcher="b"' not in text
    assert set(exporter.tracked_batchers) == set()


def test_a_failing_listener_does_not_stop_the_batcher() -> None:
    class Broken:
        def on_step(self, event: object) -> None:
            raise RuntimeError("listener bug")

        def on_finish(self, event: object) -> None:
            raise RuntimeError("listener bug")

    with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
        b.add_listener(Broken())
        assert b.generate([[1, 2]], max_new_tokens=3) == [solo([1, 2], 3)]
