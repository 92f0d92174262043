"""The main job: a built-in encoder served to many concurrent callers, one request
at a time and then through ``@batched``; every batched result is checked against
the one-at-a-time result, and throughput, latency and speed-up are reported.

The baseline is a fair one-at-a-time server: one model worker takes the requests
in the order they arrive (a FIFO queue, `ArrivalOrder`), one per model call. (Callers
taking turns on a lock are no baseline: a thread that releases it often takes it
again at once, so a few callers are served again and again while others wait, and
the median latency says nothing.)

torch is imported only when the demo runs: ``import batchkit`` never needs it.
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

from batchkit.tools.progress import Progress

TOLERANCE = 1e-4  # batched and one-at-a-time float32 results may differ by rounding only
NEEDS_TORCH = 'batchkit demo needs torch: pip install "batchkit-ml[torch]"'
BASELINE = "one at a time: one model worker serves the requests in arrival order (FIFO)"

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
    """One way of serving the requests.

    Attributes:
        name: How they were served (``"one at a time"``, ``"@batched (bucketed)"``).
        requests: Requests served.
        wall_s: Seconds from the first request to the last answer.
        p50_ms: Median request latency, in milliseconds.
        p99_ms: 99th-percentile request latency, in milliseconds.
        mean_batch_size: Mean items per model call.
        speedup: One-at-a-time wall time over this wall time.
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
        """Requests per second."""
        return self.requests / self.wall_s


@dataclass(frozen=True)
class DemoResult:
    """Both runs, and how far the batched results are from the one-at-a-time ones.

    Attributes:
        requests: Requests per run.
        callers: Concurrent caller threads.
        min_length: The shortest request, in tokens.
        max_length: The longest request, in tokens.
        rows: One `DemoRow` per run (one at a time
            first).
        baseline: What the one-at-a-time run is, in words (`BASELINE`).
        max_abs_diff: The largest absolute difference between a batched and a
            one-at-a-time result.
        dispatch_reasons: Batches of the batched run, by why each left.
    """

    requests: int
    callers: int
    min_length: int
    max_length: int
    rows: list[DemoRow]
    max_abs_diff: float
    dispatch_reasons: dict[str, int]
    baseline: str = BASELINE

    @property
    def ok(self) -> bool:
        """Batched results equal the one-at-a-time results (within float rounding)."""
        return self.max_abs_diff <= TOLERANCE

    def table(self) -> str:
        """The printed report."""
        lines = [
            f"{self.requests} requests from {self.callers} threads, "
            f"lengths {self.min_length}..{self.max_length}",
            f"{'':22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}{'speed-up':>10}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.name:22}{r.throughput:9.0f}{r.p50_ms:9.1f}{r.p99_ms:9.1f}"
                f"{r.mean_batch_size:7.1f}{r.speedup:9.2f}x"
            )
        lines.append(
            f"max |batched - alone| = {self.max_abs_diff:.1e} "
            f"(dispatch reasons: {self.dispatch_reasons})"
        )
        lines.append(self.baseline)
        lines.append("@batched (bucketed): BucketedBatcher, buckets 16/32/48, up to 32 per batch")
        return "\n".join(lines)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(NEEDS_TORCH) from None
    return torch


def build_model(seed: int = 0) -> Any:
    """The built-in model: a small transformer encoder with masked mean pooling.

    Args:
        seed: The torch seed its weights are drawn with.

    Raises:
        ImportError: torch is not installed (the message gives the pip command).
    """
    torch = _import_torch()
    torch.manual_seed(seed)

    class Encoder(torch.nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 64)
            self.layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

        def forward(self, ids: Any, mask: Any) -> Any:
            hidden = self.layer(self.embed(ids), src_key_padding_mask=~mask)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

    return Encoder().eval()


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


def run_demo(num_requests: int = 1024, callers: int = 64, *, progress: bool = False) -> DemoResult:
    """Serve ``num_requests`` token-id requests unbatched, then batched; see the module doc.

    Args:
        num_requests: Requests per run.
        callers: Threads sending them concurrently.
        progress: Draw a progress bar on stderr.

    Raises:
        ValueError: ``num_requests`` or ``callers`` is below 1.
        ImportError: torch is not installed (the message gives the pip command).
    """
    if num_requests < 1 or callers < 1:
        raise ValueError(f"need requests >= 1 and callers >= 1, got {num_requests}, {callers}")
    torch = _import_torch()
    from batchkit.batchers.bucketed import BucketedBatcher
    from batchkit.collate.pad import pad
    from batchkit.serve.batched import batched

    torch.set_num_threads(1)  # one core for the model, one for the callers
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 48, num_requests)
    requests = [rng.integers(1, 1000, n).tolist() for n in lengths]
    model = build_model()

    @torch.inference_mode()  # type: ignore[untyped-decorator, misc]
    def alone(ids: list[int]) -> Any:
        return model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))[0]

    @batched(batcher=BucketedBatcher([16, 32, 48], max_batch_size=32))
    @torch.inference_mode()  # type: ignore[untyped-decorator, misc]
    def embed(batch: list[list[int]]) -> Any:
        padded = pad(batch, return_tensors="pt")
        return model(padded.data, padded.mask)

    with (
        Progress("one at a time", num_requests, enabled=progress) as bar,
        ArrivalOrder(alone) as one_at_a_time,
    ):
        expected, t_alone, lat_alone = _serve(one_at_a_time, requests, callers, bar)
    with Progress("@batched (bucketed)", num_requests, enabled=progress) as bar:
        got, t_batched, lat_batched = _serve(embed, requests, callers, bar)
    stats = embed.stats()
    embed.close()

    def row(name: str, wall: float, lat: np.ndarray, size: float) -> DemoRow:
        p50, p99 = np.percentile(lat, [50, 99]) * 1e3
        return DemoRow(name, num_requests, wall, float(p50), float(p99), size, t_alone / wall)

    worst = max(float((a - b).abs().max()) for a, b in zip(expected, got))
    return DemoResult(
        requests=num_requests,
        callers=callers,
        min_length=int(lengths.min()),
        max_length=int(lengths.max()),
        rows=[
            row("one at a time", t_alone, lat_alone, 1.0),
            row("@batched (bucketed)", t_batched, lat_batched, stats.mean_batch_size),
        ],
        max_abs_diff=worst,
        dispatch_reasons=stats.dispatch_reasons,
    )


def main(num_requests: int = 1024, callers: int = 64, *, progress: bool | None = None) -> int:
    """Run the demo and print its table.

    Args:
        num_requests: Requests per run.
        callers: Threads sending them concurrently.
        progress: Draw a progress bar; ``None``: when stderr is a terminal.

    Returns:
        The exit status: 0 ok, 1 batched results differ, 2 torch is not installed.
    """
    show = sys.stderr.isatty() if progress is None else progress
    try:
        result = run_demo(num_requests, callers, progress=show)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(result.table())
    if not result.ok:
        print("batched results differ from one-at-a-time results", file=sys.stderr)
        return 1
    return 0
