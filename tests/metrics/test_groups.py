"""Per-group series, only when asked (``track(f, groups=True)``): exact values from
``stats().groups`` for ``@batched`` functions and continuous batchers; nothing written
and nothing read without it; tracking again switches them; groups that print alike
share one series."""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import batchkit  # noqa: E402
from batchkit.generate import ContinuousBatcher  # noqa: E402
from batchkit.metrics import GROUP_METRIC_NAMES, PrometheusMetrics  # noqa: E402
from tests.generate._toy import SlottedToy, solo  # noqa: E402
from tests.metrics._samples import value  # noqa: E402
from tests.serve._wait import wait_until  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def by_adapter(item: dict[str, Any]) -> Any:
    return item["adapter"]


def grouped(max_batch_size: int = 4, **options: Any) -> batchkit.BatchedFunction[Any, Any]:
    """A function batching items of one adapter together."""

    def answer(items: list[dict[str, Any]]) -> list[Any]:
        return [item["x"] for item in items]

    return batchkit.batched(max_batch_size=max_batch_size, group=by_adapter, **options)(answer)


def items(adapters: list[Any]) -> list[dict[str, Any]]:
    return [{"adapter": a, "x": i} for i, a in enumerate(adapters)]


def families(exporter: PrometheusMetrics) -> set[str]:
    """The family names of one scrape (counters with their ``_total``)."""
    text = exporter.generate_latest().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def group_series(exporter: PrometheusMetrics) -> list[tuple[str, dict[str, str]]]:
    """Every sample of one scrape that carries a ``group`` label."""
    text = exporter.generate_latest().decode()
    return [
        (sample.name, sample.labels)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "group" in sample.labels
    ]


def test_each_group_exports_its_requests_batches_and_queue_waits(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = grouped()
    assert exporter.track(f, name="answer", groups=True) == "answer"
    adapters = ["a"] * 5 + ["b"] * 2 + ["c"]
    assert f.map(items(adapters)) == list(range(8))
    groups = f.stats().groups
    for group, n in Counter(adapters).items():
        lb = {"batcher": "answer", "group": group}
        assert value(registry, "inference_group_admitted_requests_total", **lb) == n
        assert groups[group].requests == n
        assert value(registry, "inference_group_batches_total", **lb) == groups[group].batches
        wait = groups[group].queue_wait
        assert value(registry, "inference_group_queue_wait_seconds", quantile="0.5", **lb) == (
            wait.p50
        )
        assert value(registry, "inference_group_queue_wait_seconds", quantile="0.99", **lb) == (
            wait.p99
        )
    assert value(registry, "inference_group_batches_total", batcher="answer", group="a") >= 2
    f.close()


@given(
    adapters=st.lists(st.sampled_from(["a", "b", "c", 7]), min_size=1, max_size=24),
    max_groups=st.integers(1, 3),
)
def test_the_group_counters_add_up_to_the_functions_own(
    adapters: list[Any], max_groups: int
) -> None:
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusMetrics(registry)
    f = grouped(max_batch_size=4, max_groups_per_batch=max_groups)
    exporter.track(f, name="f", groups=True)
    assert f.map(items(adapters)) == list(range(len(adapters)))
    stats = f.stats()
    admitted = {
        g: value(registry, "inference_group_admitted_requests_total", batcher="f", group=str(g))
        for g in set(adapters)
    }
    assert admitted == {g: n for g, n in Counter(adapters).items()}
    batches = {
        g: value(registry, "inference_group_batches_total", batcher="f", group=str(g))
        for g in set(adapters)
    }
    for g, n in Counter(adapters).items():
        assert batches[g] >= math.ceil(n / 4)  # a group's batches hold at most 4 of it
    # Every batch holds one to max_groups groups, and counts once for each.
    assert stats.batches <= sum(batches.values()) <= stats.batches * max_groups
    assert len(group_series(exporter)) == len(set(adapters)) * 4  # 2 counters, 2 quantiles
    f.close()


def test_a_group_not_yet_dispatched_has_no_queue_wait_yet(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    started, release = threading.Event(), threading.Event()

    def answer(batch: list[dict[str, Any]]) -> list[Any]:
        started.set()
        assert release.wait(10)
        return [item["x"] for item in batch]

    f = batchkit.batched(max_batch_size=4, max_wait_ms=0, group=by_adapter)(answer)
    exporter.track(f, name="held", groups=True)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(f, {"adapter": "a", "x": 1})
        assert started.wait(10)  # a's batch runs (and holds the only worker)
        second = pool.submit(f, {"adapter": "b", "x": 2})
        wait_until(lambda: f.stats().queue_depth == 1)
        lb = {"batcher": "held", "group": "b"}
        assert value(registry, "inference_group_admitted_requests_total", **lb) == 1
        assert value(registry, "inference_group_batches_total", **lb) == 0
        for quantile in ("0.5", "0.99"):
            got = value(registry, "inference_group_queue_wait_seconds", quantile=quantile, **lb)
            assert math.isnan(got)
        release.set()
        assert (first.result(10), second.result(10)) == (1, 2)
    assert value(registry, "inference_group_batches_total", **lb) == 1
    f.close()


def test_a_continuous_batcher_exports_each_groups_requests_steps_and_tokens(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=4, name="gen") as b:
        exporter.track(b, groups=True)
        handles = [
            b.submit([1, 2], max_new_tokens=3, group="lora-a"),
            b.submit([3], max_new_tokens=2, group=("task", 7)),
            b.submit([4], max_new_tokens=2),  # the default group: None
        ]
        assert [h.result(timeout=10) for h in handles] == [
            solo([1, 2], 3),
            solo([3], 2),
            solo([4], 2),
        ]
        groups = b.stats().groups
    # (admitted, steps, tokens computed, tokens generated): the last token sampled is
    # never computed, so a prompt of p tokens and n new ones computes p + n - 1 in n steps.
    expected = {"lora-a": (1, 3, 4, 3), "('task', 7)": (1, 2, 2, 2), "None": (1, 2, 2, 2)}
    got = {
        group: tuple(
            value(registry, name, batcher="gen", group=group)
            for name in (
                "generation_group_admitted_requests_total",
                "generation_group_steps_total",
                "generation_group_tokens_computed_total",
                "generation_group_tokens_generated_total",
            )
        )
        for group in expected
    }
    assert got == expected
    assert {
        str(g): (s.admitted, s.steps, s.tokens_computed, s.tokens_generated)
        for g, s in groups.items()
    } == expected
    assert not any(name.startswith("inference_group") for name in families(exporter))


def test_without_groups_nothing_is_written_and_nothing_more_is_read(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = grouped()
    exporter.track(f, name="f")
    f.map(items(["a", "b", "a"]))
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2, name="gen") as b:
        exporter.track(b)
        assert b.generate([[1]], max_new_tokens=2) == [solo([1], 2)]
        reads: Counter[str] = Counter()

        def refused() -> Any:
            raise AssertionError("a scrape read f.stats() for group series not asked for")

        def counted() -> Any:
            reads["batcher"] += 1
            return type(b).stats(b)

        f.stats = refused  # type: ignore[method-assign]
        b.stats = counted  # type: ignore[method-assign]
        scraped = families(exporter)
        assert reads["batcher"] == 1  # the batcher's own scrape-time counters, as before
        assert not [name for name in scraped if "_group_" in name]
        assert group_series(exporter) == []
    f.close()


def test_tracking_again_switches_the_group_series_and_keeps_the_others(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = grouped()
    exporter.track(f, name="f")
    f.map(items(["a", "b"]))
    assert group_series(exporter) == []
    exporter.track(f, name="f", groups=True)  # on: counted since f was made
    f.map(items(["a"]))
    assert value(registry, "inference_group_admitted_requests_total", batcher="f", group="a") == 2
    assert value(registry, "inference_group_admitted_requests_total", batcher="f", group="b") == 1
    exporter.track(f, name="f")  # off again
    assert group_series(exporter) == []
    assert not [name for name in families(exporter) if "_group_" in name]
    # The event-recorded series went on untouched throughout.
    assert value(registry, "inference_requests_total", batcher="f", outcome="ok") == 3
    assert exporter.tracked == {"f": f}
    f.close()


def test_groups_true_for_a_function_without_groups_is_refused(
    exporter: PrometheusMetrics,
) -> None:
    f = batchkit.batched(max_batch_size=4)(lambda xs: xs)
    with pytest.raises(ValueError, match=r"groups=True: .*<lambda> has no groups to export"):
        exporter.track(f, name="plain", groups=True)
    with pytest.raises(TypeError, match="groups must be True or False, got 'yes'"):
        exporter.track(grouped(), groups="yes")  # type: ignore[arg-type]
    assert exporter.tracked == {}
    f.close()


def test_groups_that_print_alike_share_one_series(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = grouped()
    exporter.track(f, name="f", groups=True)
    f.map(items([1, "1", 1, None, "None"]))
    groups = f.stats().groups
    assert set(groups) == {1, "1", None, "None"}
    samples = group_series(exporter)
    assert len(samples) == len({(n, tuple(sorted(lb.items()))) for n, lb in samples})
    lb = {"batcher": "f", "group": "1"}
    assert value(registry, "inference_group_admitted_requests_total", **lb) == 3
    assert value(registry, "inference_group_batches_total", **lb) == (
        groups[1].batches + groups["1"].batches
    )
    assert value(registry, "inference_group_queue_wait_seconds", quantile="0.99", **lb) == max(
        groups[1].queue_wait.p99, groups["1"].queue_wait.p99
    )
    assert (
        value(registry, "inference_group_admitted_requests_total", batcher="f", group="None") == 2
    )
    f.close()


def test_untracked_functions_lose_their_group_series(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f, g = grouped(), grouped()
    exporter.track(f, name="f", groups=True)
    exporter.track(g, name="g", groups=True)
    f.map(items(["a"]))
    g.map(items(["a"]))
    exporter.untrack(f)
    assert {lb["batcher"] for _, lb in group_series(exporter)} == {"g"}
    exporter.untrack(g)
    assert not [name for name in families(exporter) if "_group_" in name]
    f.close()
    g.close()


def test_every_group_family_is_exported_documented_and_namespaced(
    registry: Any,
) -> None:
    exporter = PrometheusMetrics(registry, namespace="svc")
    f = grouped()
    exporter.track(f, name="f", groups=True)
    f.map(items(["a"]))
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2, name="gen") as b:
        exporter.track(b, groups=True)
        b.generate([[1]], max_new_tokens=1)
        exported = {n for n in families(exporter) if "_group_" in n}
    assert exported == {f"svc_{name}" for name in GROUP_METRIC_NAMES}
    table = DOCS.read_text().split("## Per-group series", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `((?:inference|generation)_group_\w+)` \|", table, re.M))
    assert documented == set(GROUP_METRIC_NAMES)
    assert value(registry, "svc_inference_group_admitted_requests_total", batcher="f", group="a")
    f.close()
