"""A Ray Serve deployment whose replicas each batch their requests with ``@batched``.

Each replica holds one model (a small deterministic token encoder) wrapped with
``@batched``: requests are grouped by length bucket (``BucketedBatcher``), padded
with ``batchkit.pad`` and run together; deadlines come from ``acall(timeout=...)``,
backpressure from ``max_queue_size`` (sized to Serve's ``max_ongoing_requests``, see
docs/scaling.md) and batchkit's metrics go through Ray's metrics agent
(``RayMetrics``), tagged per replica beside Serve's own.

The script starts a local Ray (2 CPUs, no dashboard, no HTTP proxy), runs the
deployment with 2 replicas (``--autoscale``: 1..2 replicas by ongoing requests),
sends 400 concurrent requests through a ``DeploymentHandle``, checks every result
equals the unbatched one and prints each replica's batches.

Run:  python examples/ray_serve_app.py   (about 15 s on 2 idle cores, 40 s on busy ones)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from typing import Any

# Before Ray is imported (Serve reads these at import): no usage report; and on a
# small, busy machine give the router's queue-length probes more than 0.1 s.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")

import numpy as np  # noqa: E402

import batchkit  # noqa: E402
from batchkit.integrations.ray import RayMetrics, ReplicaStats, replica_stats  # noqa: E402

try:
    import ray
    from ray import serve
except ImportError:  # the example is optional: it needs batchkit-ml[ray]
    print("skipped: Ray Serve is not installed (pip install 'batchkit-ml[ray]')")
    sys.exit(0)

MAX_BATCH_SIZE = 16
MAX_ONGOING_REQUESTS = 4 * MAX_BATCH_SIZE  # one batch running, the next ones filling
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    # Scale out when a replica holds more than two batches' worth of requests.
    "target_ongoing_requests": 2 * MAX_BATCH_SIZE,
}


class TokenEncoder:
    """A stand-in model: masked sum of integer token embeddings, then a mix.

    Integer arithmetic keeps batched and unbatched results bit-identical (a real
    float model is compared with ``np.allclose``).
    """

    def __init__(self, vocab_size: int = 1000, dim: int = 8, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.table = rng.integers(-50, 50, size=(vocab_size, dim), dtype=np.int64)
        self.mix = rng.integers(-5, 5, size=(dim, dim), dtype=np.int64)

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``ids``/``mask`` ``[B, L]`` -> ``[B, dim]``; padding (mask False) adds nothing."""
        pooled = (self.table[ids] * mask[..., None]).sum(axis=1)
        out: np.ndarray = pooled @ self.mix
        return out


@serve.deployment(num_replicas=2, max_ongoing_requests=MAX_ONGOING_REQUESTS)
class Encoder:
    """One replica: a model behind its own ``@batched`` queue."""

    def __init__(self, max_batch_size: int = MAX_BATCH_SIZE, max_wait_ms: float = 5.0) -> None:
        self.model = TokenEncoder()
        self.encode = batchkit.batched(
            batcher=batchkit.BucketedBatcher(
                [8, 16, 32, 64], max_batch_size=max_batch_size, max_wait_ms=max_wait_ms
            ),
            collate=batchkit.pad,
            # Every request in this replica fits: Serve admits at most
            # max_ongoing_requests, so QueueFull never fires behind Serve's own limit.
            max_queue_size=MAX_ONGOING_REQUESTS,
        )(self._forward)
        RayMetrics().track(self.encode, name="encoder")
        self.replica = serve.get_replica_context().replica_tag

    def _forward(self, batch: batchkit.Padded) -> list[dict[str, Any]]:
        out = self.model(batch.data, batch.mask)
        return [{"embedding": row, "batch_size": batch.batch_size} for row in out]

    async def __call__(self, tokens: list[int]) -> dict[str, Any]:
        """Encode one token sequence; the result names the replica and its batch size."""
        result: dict[str, Any] = await self.encode.acall(np.asarray(tokens), timeout=30.0)
        return {**result, "replica": self.replica}

    def stats(self) -> ReplicaStats:
        """This replica's batching stats (handle.stats.remote() reaches one replica)."""
        return replica_stats(self.encode)

    def __del__(self) -> None:
        self.encode.close(timeout=5)  # finish what is queued when Serve stops the replica


def unbatched(model: TokenEncoder, tokens: list[int]) -> np.ndarray:
    """The reference: one sequence alone, no padding."""
    padded = batchkit.pad([np.asarray(tokens)])
    return model(padded.data, padded.mask)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--autoscale", action="store_true", help="1..2 replicas, autoscaled")
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    requests = [
        rng.integers(1, 1000, size=int(n)).tolist() for n in rng.integers(1, 60, args.requests)
    ]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = None
    try:
        serve.start(proxy_location="Disabled")  # handles only: no HTTP port
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0.5}}
        if args.autoscale:
            options |= {"num_replicas": "auto", "autoscaling_config": AUTOSCALING}
        app = Encoder.options(**options).bind()
        handle = serve.run(app, name="encoder", route_prefix=None)

        responses = [handle.remote(tokens) for tokens in requests]  # all in flight at once
        results = [r.result(timeout_s=60) for r in responses]

        model = TokenEncoder()
        for tokens, result in zip(requests, results):
            if not np.array_equal(result["embedding"], unbatched(model, tokens)):
                raise SystemExit(f"mismatch for a request of {len(tokens)} tokens")
        sizes: dict[str, list[int]] = defaultdict(list)
        for result in results:
            sizes[result["replica"]].append(result["batch_size"])
        print(f"{len(results)} requests, every result equals the unbatched one")
        print(f"{'replica':<40} {'requests':>8} {'mean batch (per request)':>25}")
        for replica, seen in sorted(sizes.items()):
            print(f"{replica:<40} {len(seen):>8} {np.mean(seen):>25.1f}")
    finally:
        shut_down(handle)


def shut_down(handle: Any) -> None:
    """Stop the application, then Ray, without killing anything mid-task.

    The application is deleted first: Serve drains each replica (its ``__del__``
    closes the batcher, which finishes what is queued) and waits for it to stop.
    Then the handle's router is stopped, so that no long poll of the controller is
    left open, and Ray itself shuts down. (``serve.shutdown()`` here made Ray kill its
    own controller while that controller's shutdown and the handle's long poll were
    still running: Ray then reported both tasks as killed by ``ray.kill`` on exit.)
    """
    if handle is not None:
        serve.delete("encoder")  # blocks until the replicas have drained and stopped
        handle.shutdown()
    ray.shutdown()  # the local cluster and its Serve controller stop with the driver


if __name__ == "__main__":
    main()
