"""The main job: a built-in encoder served to many concurrent callers, one request
at a time and through ``@batched``; every batched result is checked against the
one-at-a-time result, and throughput, latency and speed-up are reported.

The comparison is even-handed: both servers get the same warm-up burst before
anything is timed, and each is timed in several rounds in alternating order
(one at a time first in odd rounds, batched first in even ones), so neither pays
the model's cold start or a slower stretch of a busy machine alone. The speed-up is
the median of the rounds' one-at-a-time wall time over the median batched one.

The baseline is a fair one-at-a-time server: one model worker takes the requests
in the order they arrive (a FIFO queue, `ArrivalOrder`), one per model call. (Callers
taking turns on a lock are no baseline: a thread that releases it often takes it
again at once, so a few callers are served again and again while others wait, and
the median latency says nothing.)

The model is `batchkit.tools.encoder`'s: torch's when torch is installed, else the
numpy one (the core install needs nothing more).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import numpy as np

from batchkit.tools.encoder import Backend, Encode, load_encoder
from batchkit.tools.progress import Progress

TOLERANCE = 1e-4  # batched and one-at-a-time float32 results may differ by rounding only
BASELINE = "one at a time: one model worker serves the requests in arrival order (FIFO)"
BATCHED = "@batched (bucketed): BucketedBatcher, buckets 16/32/48, up to 32 per batch"
# What each dispatch reason means, in the words the report prints.
REASONS = {
    "full": "a bucket held a full batch",
    "max_wait": "its oldest request had waited max_wait_ms",
    "idle": "the model was free, so waiting requests went at once",
    "deadline": "waiting longer would have made a request late",
    "closing": "the function was closing",
}

T = TypeVar("T")
R = TypeVar("R")


class ArrivalOrder(Generic[T, R]):
    """A one-at-a-time server: callers from any thread, one worker, arrival order.

    Each call joins a FIFO queue and blocks until the worker has run ``fn`` on its
    item alone; the worker takes the items in the order the calls arrived. The fair
    unbatched baseline: every caller waits for exactly the requests ahead of it.

    Args:
        fn: What the worker runs, on one item at a time.
    """

    def __init__(self, fn: Callable[[T], R]) -> None:
        self._fn = fn
        self._queue: queue.Queue[tuple[T, Future[R]] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="one-at-a-time", daemon=True)
        self._worker.start()

    def __call__(self, item: T) -> R:
        """``fn(item)``, run by the worker once the requests ahead of it are served.

        Args:
            item: One request.

        Raises:
            RuntimeError: The server is closed.
            Exception: What ``fn`` raised for this item.
        """
        if not self._worker.is_alive():
            raise RuntimeError("this one-at-a-time server is closed")
        answer: Future[R] = Future()
        self._queue.put((item, answer))
        return answer.result()

    @property
    def waiting(self) -> int:
        """Requests queued and not yet taken by the worker."""
        return self._queue.qsize()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            item, answer = job
            try:
                answer.set_result(self._fn(item))
            except Exception as exc:  # noqa: BLE001 - the caller's own error, raised in it
                answer.set_exception(exc)

    def close(self) -> None:
        """Serve what is queued, then stop the worker (a second call does nothing)."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    def __enter__(self) -> ArrivalOrder[T, R]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class DemoRow:
    """One way of serving the requests, over every timed round.

    Attributes:
        name: How they were served (``"one at a time"``, ``"@batched (bucketed)"``).
        requests: Requests served per round.
        wall_s: The median over the rounds of the seconds from the first request to
            the last answer.
        p50_ms: Median request latency over every round, in milliseconds.
        p99_ms: 99th-percentile request latency over every round, in milliseconds.
        mean_batch_size: Mean items per model call.
        speedup: The one-at-a-time `wall_s` over this one.
    """

    name: str
    requests: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_batch_size: float
    speedup: float

    @property
    def throughput(self) -> float:
        """Requests per second (at the median wall time)."""
        return self.requests / self.wall_s


@dataclass(frozen=True)
class DemoResult:
    """Both servers' figures, and how far the batched results are from the
    one-at-a-time ones.

    Attributes:
        requests: Requests per round.
        callers: Concurrent caller threads.
        min_length: The shortest request, in tokens.
        max_length: The longest request, in tokens.
        rows: One `DemoRow` per server (one at a time first).
        max_abs_diff: The largest absolute difference between a batched and a
            one-at-a-time result.
        dispatch_reasons: Batches of the timed batched rounds, by why each left.
        model: The model, in words.
        rounds: Timed rounds per server.
        warmup: Requests each server served before the timed rounds.
        baseline: What the one-at-a-time run is, in words (`BASELINE`).
    """

    requests: int
    callers: int
    min_length: int
    max_length: int
    rows: list[DemoRow]
    max_abs_diff: float
    dispatch_reasons: dict[str, int]
    model: str = "built-in encoder"
    rounds: int = 1
    warmup: int = 0
    baseline: str = BASELINE

    @property
    def ok(self) -> bool:
        """Batched results equal the one-at-a-time results (within float rounding)."""
        return self.max_abs_diff <= TOLERANCE

    def verdict(self) -> str:
        """The equality check's line: its verdict, the difference and the tolerance."""
        word = "equal" if self.ok else "DIFFERENT"
        return (
            f"results: {word} (largest |batched - alone| = {self.max_abs_diff:.1e}, "
            f"tolerance {TOLERANCE:.0e})"
        )

    def reasons(self) -> str:
        """Why the batched run's batches left the queue, in words."""
        parts = [
            f"{n} {reason} ({REASONS.get(reason, reason)})"
            for reason, n in sorted(self.dispatch_reasons.items(), key=lambda kv: -kv[1])
        ]
        return "batches left because: " + "; ".join(parts)

    def table(self) -> str:
        """The printed report."""
        lines = [
            f"{self.requests} requests from {self.callers} "
            f"{'thread' if self.callers == 1 else 'threads'}, "
            f"lengths {self.min_length}..{self.max_length}; {self.model}",
            f"each server: {self.warmup} warm-up requests, then {self.rounds} timed "
            f"{'round' if self.rounds == 1 else 'rounds in alternating order (medians shown)'}",
            f"{'':22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}{'speed-up':>10}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.name:22}{r.throughput:9.0f}{r.p50_ms:9.1f}{r.p99_ms:9.1f}"
                f"{r.mean_batch_size:7.1f}{r.speedup:9.2f}x"
            )
        lines.append(self.verdict())
        lines.append(self.reasons())
        if self.callers == 1:
            lines.append(
                "one caller: never more than one request waits, so nothing can be batched; "
                "about 1.0x is the expected speed-up (what @batched itself costs)"
            )
        lines.append(self.baseline)
        lines.append(BATCHED)
        return "\n".join(lines)


def _serve(
    call: Callable[[list[int]], Any], requests: list[list[int]], callers: int, progress: Progress
) -> tuple[list[Any], float, np.ndarray]:
    """Fire every request from ``callers`` threads; results in order, wall time, latencies."""
    latencies = np.zeros(len(requests))

    def one(i: int) -> Any:
        start = time.perf_counter()
        out = call(requests[i])
        latencies[i] = time.perf_counter() - start
        progress.advance()
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(one, range(len(requests))))
    return results, time.perf_counter() - start, latencies


def _one_row(encode: Encode) -> Callable[[list[int]], np.ndarray]:
    """The model on one request alone (a batch of one, no padding)."""

    def alone(ids: list[int]) -> np.ndarray:
        row = np.asarray([ids], dtype=np.int64)
        out: np.ndarray = encode(row, np.ones(row.shape, dtype=bool))[0]
        return out

    return alone


def _whole_batch(encode: Encode) -> Callable[[list[list[int]]], np.ndarray]:
    """The model on a padded batch of requests."""
    from batchkit.collate.pad import pad

    def batch(requests: list[list[int]]) -> np.ndarray:
        padded = pad(requests)
        return encode(np.asarray(padded.data, dtype=np.int64), np.asarray(padded.mask, bool))

    return batch


def run_demo(
    num_requests: int = 1024,
    callers: int = 64,
    *,
    rounds: int = 3,
    warmup: int = 64,
    backend: Backend = "auto",
    progress: bool = False,
) -> DemoResult:
    """Serve ``num_requests`` token-id requests one at a time and batched; see the
    module doc.

    With the numpy model, OpenBLAS is put on one thread for the rest of the process
    (as torch is with `torch.set_num_threads(1)`): one core for the model.

    Args:
        num_requests: Requests per timed round.
        callers: Threads sending them concurrently.
        rounds: Timed rounds per server, in alternating order.
        warmup: Requests each server serves before the timed rounds (the first
            ``warmup`` of them, from the same callers).
        backend: The model: ``"torch"``, ``"numpy"``, or ``"auto"`` (torch when it
            is installed).
        progress: Draw a progress bar on stderr.

    Raises:
        ValueError: ``num_requests``, ``callers`` or ``rounds`` is below 1, or
            ``warmup`` below 0.
        ImportError: ``backend="torch"`` and torch is not installed.
    """
    if num_requests < 1 or callers < 1 or rounds < 1 or warmup < 0:
        raise ValueError(
            "need requests, callers and rounds >= 1 and warmup >= 0, got "
            f"{num_requests}, {callers}, {rounds}, {warmup}"
        )
    from batchkit.batchers.bucketed import BucketedBatcher
    from batchkit.serve.batched import batched

    model, encode = load_encoder(backend)
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 48, num_requests)
    requests = [rng.integers(1, 1000, n).tolist() for n in lengths]
    embed = batched(batcher=BucketedBatcher([16, 32, 48], max_batch_size=32))(_whole_batch(encode))
    walls: dict[str, list[float]] = {"one at a time": [], "@batched (bucketed)": []}
    latencies: dict[str, list[np.ndarray]] = {name: [] for name in walls}
    results: dict[str, list[Any]] = {}
    with ArrivalOrder(_one_row(encode)) as one_at_a_time, embed:
        servers: dict[str, Callable[[list[int]], Any]] = {
            "one at a time": one_at_a_time,
            "@batched (bucketed)": embed,
        }
        for name, server in servers.items():  # the same warm-up for both
            with Progress(f"warm-up, {name}", warmup, enabled=progress) as bar:
                _serve(server, requests[:warmup], callers, bar)
        before = embed.stats().dispatch_reasons
        for round_ in range(rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                label = f"round {round_ + 1}/{rounds}, {name}"
                with Progress(label, num_requests, enabled=progress) as bar:
                    got, wall, lat = _serve(servers[name], requests, callers, bar)
                results[name] = got
                walls[name].append(wall)
                latencies[name].append(lat)
        stats = embed.stats()
    reasons = {
        reason: n - before.get(reason, 0)
        for reason, n in stats.dispatch_reasons.items()
        if n - before.get(reason, 0)
    }
    timed_batches = sum(reasons.values())
    baseline_wall = float(np.median(walls["one at a time"]))

    def row(name: str) -> DemoRow:
        wall = float(np.median(walls[name]))
        p50, p99 = np.percentile(np.concatenate(latencies[name]), [50, 99]) * 1e3
        size = num_requests * rounds / timed_batches if name != "one at a time" else 1.0
        return DemoRow(name, num_requests, wall, float(p50), float(p99), size, baseline_wall / wall)

    expected, got = results["one at a time"], results["@batched (bucketed)"]
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(expected, got))
    return DemoResult(
        requests=num_requests,
        callers=callers,
        min_length=int(lengths.min()),
        max_length=int(lengths.max()),
        rows=[row(name) for name in walls],
        max_abs_diff=worst,
        dispatch_reasons=reasons,
        model=model,
        rounds=rounds,
        warmup=warmup,
    )


def main(
    num_requests: int = 1024,
    callers: int = 64,
    *,
    rounds: int = 3,
    backend: Backend = "auto",
    progress: bool | None = None,
) -> int:
    """Run the demo and print its table.

    Args:
        num_requests: Requests per timed round.
        callers: Threads sending them concurrently.
        rounds: Timed rounds per server.
        backend: The model: ``"torch"``, ``"numpy"`` or ``"auto"``.
        progress: Draw a progress bar; ``None``: when stderr is a terminal.

    Returns:
        The exit status: 0 ok, 1 batched results differ, 2 ``backend="torch"``
        without torch installed.
    """
    show = sys.stderr.isatty() if progress is None else progress
    try:
        result = run_demo(num_requests, callers, rounds=rounds, backend=backend, progress=show)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(result.table())
    if not result.ok:
        print("batched results differ from one-at-a-time results", file=sys.stderr)
        return 1
    return 0
