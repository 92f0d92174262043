"""batchkit on a local Ray: a Serve deployment with 2 replicas, Ray Data map_batches.

One Ray (2 CPUs, no dashboard, nothing beyond 127.0.0.1) is shared by every test
here and shut down at the end of the module.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

# Read when Ray is imported: no usage report, and routing probes that tolerate a
# busy 2-core machine.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")
ray = pytest.importorskip(
    "ray", reason='the Ray tests need the ray extra: pip install -e ".[test,ray]"'
)

import batchkit  # noqa: E402
from batchkit.integrations.ray import (  # noqa: E402
    BatchkitPredictor,
    RayMetrics,
    ReplicaStats,
    replica_stats,
)

pytestmark = pytest.mark.ray

MAX_BATCH_SIZE = 16


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


# -- the model ----------------------------------------------------------------


def make_model() -> Any:
    """Per-token outputs (a running sum of integer embeddings): exact, and padding on
    the right cannot change a row's real prefix."""
    table = np.random.default_rng(0).integers(-50, 50, size=(1000, 4), dtype=np.int64)

    def run(padded: batchkit.Padded) -> list[np.ndarray]:
        return padded.unpad(np.cumsum(table[padded.data], axis=1))

    return run


def unbatched(tokens: np.ndarray) -> np.ndarray:
    result: np.ndarray = make_model()(batchkit.pad([tokens]))[0]
    return result


def token_rows(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.0, 0.8, n).astype(int), 1, 200)
    return [rng.integers(1, 1000, size=int(k), dtype=np.int64) for k in lengths]


# -- Ray Serve ------------------------------------------------------------------


def encoder_deployment() -> Any:
    from ray import serve

    @serve.deployment(
        num_replicas=2,
        max_ongoing_requests=4 * MAX_BATCH_SIZE,
        ray_actor_options={"num_cpus": 0.5},
    )
    class Encoder:
        def __init__(self) -> None:
            model = make_model()

            def forward(padded: batchkit.Padded) -> list[tuple[np.ndarray, int]]:
                return [(out, padded.batch_size) for out in model(padded)]

            self.encode = batchkit.batched(
                batcher=batchkit.BucketedBatcher(
                    [16, 32, 64], max_batch_size=MAX_BATCH_SIZE, max_wait_ms=10
                ),
                collate=batchkit.pad,
                max_queue_size=4 * MAX_BATCH_SIZE,
            )(forward)
            RayMetrics().track(self.encode, name="encoder")

        async def __call__(self, tokens: np.ndarray) -> tuple[np.ndarray, int, str]:
            out, size = await self.encode.acall(tokens, timeout=60)
            return out, size, replica_stats(self.encode).replica

        def stats(self) -> ReplicaStats:
            return replica_stats(self.encode)

    return Encoder


def test_serve_two_replicas_batch_and_match_unbatched(local_ray: None) -> None:
    from ray import serve

    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(encoder_deployment().bind(), name="encoder", route_prefix=None)
        sizes: dict[str, list[int]] = defaultdict(list)
        # Serve's router may send one replica only a trickle on a busy 2-core machine:
        # send bursts (at most 3) until both replicas have formed a batch.
        for burst in range(3):
            rows = token_rows(300, seed=1 + burst)
            responses = [handle.remote(tokens) for tokens in rows]  # all in flight at once
            results = [r.result(timeout_s=60) for r in responses]
            for tokens, (out, size, replica) in zip(rows, results):
                assert np.array_equal(out, unbatched(tokens))
                sizes[replica].append(size)
            if len(sizes) == 2 and all(max(seen) > 1 for seen in sizes.values()):
                break
        assert len(sizes) == 2, "both replicas served requests"
        for replica, seen in sizes.items():
            assert max(seen) > 1, f"replica {replica} formed no batch"

        # Each stats() call reaches one replica; its counters agree with the results.
        reports = [handle.stats.remote().result(timeout_s=30) for _ in range(6)]
        for report in reports:
            assert report.deployment == "Encoder" and report.replica in sizes
            assert report.stats.requests == len(sizes[report.replica])
            assert report.stats.mean_batch_size > 1
    finally:
        serve.shutdown()


# -- Ray Data ---------------------------------------------------------------------


def test_data_map_batches_keeps_rows_and_order(local_ray: None) -> None:
    rows = token_rows(3000, seed=2)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ds = ray.data.from_items([{"id": i, "input_ids": r} for i, r in enumerate(rows)])
    ds = ds.repartition(4).map_batches(
        BatchkitPredictor,
        fn_constructor_kwargs={
            "model_factory": make_model,
            "policy": batchkit.SortedBatcher(batch_size=32, max_tokens=2048),
            "collate": batchkit.pad,
        },
        batch_size=500,
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.5,
    )
    out = ds.take_all()
    assert [r["id"] for r in out] == list(range(len(rows)))
    for tokens, row in zip(rows, out):
        assert np.array_equal(row["input_ids"], tokens)
        assert np.array_equal(row["output"], unbatched(tokens))


# -- metrics through Ray's agent ----------------------------------------------------


def test_ray_metrics_records_every_event(local_ray: None) -> None:
    @batchkit.batched(batcher=batchkit.SortedBatcher(batch_size=4), max_queue_size=3)
    def double(xs: list[list[int]]) -> list[int]:
        return [2 * len(x) for x in xs]

    metrics = RayMetrics(namespace="test")
    assert metrics.track(double, name="double") == "double"
    with pytest.raises(ValueError, match="already tracked"):
        metrics.track(double, name="double")
    errors: list[str] = []

    class Spy:  # notify() logs and swallows listener errors: surface them here
        def on_batch(self, event: Any) -> None:
            try:
                tracker.on_batch(event)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        def on_drop(self, event: Any) -> None:
            try:
                tracker.on_drop(event)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

    tracker = metrics._tracked["double"]
    double.remove_listener(tracker)
    double.add_listener(Spy())
    assert double.map([[1], [1, 2], [1, 2, 3]]) == [2, 4, 6]
    with pytest.raises(batchkit.QueueFull):  # a drop event: rejected
        double.map([[1]] * 4)
    double.close()
    assert errors == []
    stats = replica_stats(double)
    assert (stats.deployment, stats.replica) == ("", "")
    assert (stats.stats.requests, stats.stats.rejected) == (3, 4)
