"""Compile benchmark: a small torch encoder behind `@batched`, eager, compiled with
``dynamic=True``, and compiled under a `ShapeBuckets` grid (``shapes=``).

The model is the demo's torch encoder (batchkit/tools/encoder.py: token embeddings,
one ``TransformerEncoderLayer``, masked mean pooling) as a module taking a padded
batch of ids and its mask. Requests are token sequences with long-tailed lengths
(lognormal, median 24, clipped to [4, 128]). Three systems serve the same traffic:

- ``eager``: the module itself, batches padded to their longest item
  (`DynamicBatcher`, up to 8 items);
- ``dynamic=True``: ``torch.compile(module, dynamic=True)`` (inductor), the same
  batches;
- ``shapes=``: ``torch.compile(module, dynamic=False)`` (inductor) under
  ``@batched(shapes=ShapeBuckets(batch_sizes=(1, 4, 8), lengths=(32, 64, 128)))``:
  every call is one of the grid's 9 cells, each compiled by one call up front.

For each it reports the compilations (counted by a backend that counts, then calls
inductor) during warm-up and after it, the warm-up time (compiling included), the
steady throughput (closed loop: every request of a 512-request set submitted at
once; median of 5 rounds), the p50/p99 latency at 1x load (open-loop Poisson
arrivals at the eager system's steady throughput, from 32 caller threads, over 5
rounds), the calls and their mean batch size, and the padding paid (the share of
computed token slots, batch size times length summed over the calls, that hold no
request's token; dummy rows count as padding). The three systems are warmed up one
after the other, then measured interleaved, round by round in a rotated order, so
that a shared machine's drift hits them alike. Every system's results are first
checked against the module applied to each item alone.

Usage::

    python benchmarks/compile.py            # ~3-5 min on 2 cores (most of it compiling)
    python benchmarks/compile.py --quick    # fewer requests, shorter load
"""

from __future__ import annotations

import argparse
import copy
import functools
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import issue_from_threads, poisson_arrivals  # noqa: E402
from _report import percentile, rotated  # noqa: E402

import batchkit  # noqa: E402
from batchkit.tools.encoder import HEADS, HIDDEN, VOCABULARY, WIDTH  # noqa: E402

GRID = batchkit.ShapeBuckets(batch_sizes=(1, 4, 8), lengths=(32, 64, 128))
MAX_BATCH = 8
MAX_WAIT_MS = 2.0
THREADS = 32


class Encoder(torch.nn.Module):
    """batchkit/tools/encoder.py's torch encoder as a module: ids, mask -> [B, WIDTH]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.layer = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, HIDDEN, dropout=0.0, batch_first=True
        )

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.layer(self.embed(ids), src_key_padding_mask=~mask)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


@dataclass
class Counts:
    """Compilations and the token slots the model computed over."""

    compiles: int = 0
    slots: int = 0
    calls: list[tuple[int, int]] = field(default_factory=list)


def counting_inductor(counts: Counts) -> Callable[..., Any]:
    """A torch.compile backend that counts each graph it is given, then compiles it
    with inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: Any, example_inputs: Any) -> Any:
        counts.compiles += 1
        return compile_fx(graph, example_inputs)

    return backend


def make_items(rng: np.random.Generator, n: int) -> list[torch.Tensor]:
    lengths = np.clip(rng.lognormal(np.log(24), 0.8, size=n).astype(int), 4, GRID.max_length)
    return [torch.randint(0, VOCABULARY, (int(k),)) for k in lengths]


def own_code(module: Encoder) -> Encoder:
    """``module`` as an instance of a subclass whose ``forward`` has a code object of
    its own: dynamo keeps its compiled graphs (and counts its recompilations) per code
    object, so two compiled systems sharing ``Encoder.forward`` would evict each other.
    """
    forward = Encoder.forward
    code = forward.__code__.replace()  # an equal but distinct code object
    own = type("Encoder", (Encoder,), {"forward": types.FunctionType(code, forward.__globals__)})
    copied = copy.copy(module)
    copied.__class__ = own
    return copied


def build(system: str, module: Encoder, counts: Counts) -> tuple[Any, Callable[..., Any]]:
    """The batched function of one system, and the model it calls."""
    if system == "eager":
        model: Callable[..., torch.Tensor] = module
    else:
        model = torch.compile(
            own_code(module), backend=counting_inductor(counts), dynamic=(system == "dynamic=True")
        )
    collate = functools.partial(batchkit.pad, return_tensors="pt")
    options: dict[str, Any] = (
        {"shapes": GRID} if system == "shapes=" else {"max_batch_size": MAX_BATCH}
    )

    @batchkit.batched(collate=collate, max_wait_ms=MAX_WAIT_MS, per_token=False, **options)
    def encode(batch: batchkit.Padded) -> torch.Tensor:
        counts.slots += batch.data.numel()
        counts.calls.append(tuple(batch.data.shape))
        with torch.inference_mode():
            return model(batch.data, batch.mask)

    return encode, model


@dataclass
class Served:
    """One system, warmed up, and what it measured."""

    f: Any
    counts: Counts
    warm_compiles: int
    warm_s: float
    throughputs: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    real_tokens: int = 0


def warm_up(system: str, module: Encoder, args: argparse.Namespace) -> Served:
    """Build one system and serve the warm-up traffic (under ``shapes=``, every cell
    compiled first); check its results against the module on each item alone."""
    counts = Counts()
    f, model = build(system, module, counts)
    start = time.perf_counter()
    if system == "shapes=":  # every cell compiled before any traffic, called as encode calls
        for cell in GRID.cells:  # it: inputs made outside inference mode, the call inside
            ids, mask = torch.zeros(cell, dtype=torch.int64), torch.ones(cell, dtype=torch.bool)
            with torch.inference_mode():
                model(ids, mask)
    warm_items = make_items(np.random.default_rng(1), args.warm)
    warm_results = f.map(warm_items)
    served = Served(f, counts, counts.compiles, time.perf_counter() - start)
    with torch.inference_mode():
        for item, got in zip(warm_items[:16], warm_results, strict=False):
            want = module(item[None], torch.ones(1, len(item), dtype=torch.bool))[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    counts.slots, counts.calls = 0, []
    return served


def closed_loop(f: Any, items: list[torch.Tensor]) -> float:
    """Requests per second with every request submitted at once."""
    start = time.perf_counter()
    f.map(items)
    return len(items) / (time.perf_counter() - start)


def open_loop(f: Any, items: list[torch.Tensor], arrivals: list[float]) -> list[float]:
    """Latencies (s, from each scheduled arrival) of requests made at ``arrivals``."""
    latencies = [0.0] * len(arrivals)

    def one(i: int, scheduled: float) -> None:
        f(items[i % len(items)])
        latencies[i] = time.perf_counter() - scheduled

    issue_from_threads(arrivals, one, THREADS)
    return latencies


def measure(
    served: dict[str, Served], items: list[torch.Tensor], args: argparse.Namespace
) -> float:
    """Closed-loop rounds, then open-loop rounds at 1x (the eager system's median
    throughput), the systems interleaved in a rotated order each round so that the
    shared machine's drift hits them alike; returns the 1x rate."""
    names = list(served)
    tokens = sum(len(x) for x in items)
    for k in range(args.rounds):
        for name in rotated(names, k):
            served[name].throughputs.append(closed_loop(served[name].f, items))
            served[name].real_tokens += tokens
    rate = statistics.median(served["eager"].throughputs)
    rng = random.Random(7)
    for k in range(args.rounds):
        arrivals = poisson_arrivals(rng, rate, 0.0, args.seconds / args.rounds)
        for name in rotated(names, k):
            served[name].latencies += open_loop(served[name].f, items, arrivals)
            served[name].real_tokens += sum(
                len(items[i % len(items)]) for i in range(len(arrivals))
            )
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter load")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    args = parser.parse_args(argv)
    args.requests = 192 if args.quick else 512
    args.warm = 32 if args.quick else 64
    args.rounds = 3 if args.quick else 5
    args.seconds = 3.0 if args.quick else 6.0
    torch.set_num_threads(args.threads)
    # Compile from scratch (inductor's on-disk caches would hide the warm-up's cost).
    torch._inductor.config.force_disable_caches = True
    config = torch._dynamo.config  # enough recompilations that no cell falls back to eager
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, len(GRID.cells) + 8)
    torch.manual_seed(0)
    module = Encoder().eval()
    items = make_items(np.random.default_rng(0), args.requests)
    lengths = [len(x) for x in items]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(items)} "
        f"requests, lengths {min(lengths)}..{max(lengths)} (median "
        f"{int(statistics.median(lengths))}); grid {GRID!r}; max wait {MAX_WAIT_MS} ms"
    )
    served: dict[str, Served] = {}
    for system in ("eager", "dynamic=True", "shapes="):
        served[system] = warm_up(system, module, args)
        print(f"  {system}: warmed up", flush=True)
    try:
        rate = measure(served, items, args)
    finally:
        for system in served.values():
            system.f.close()
    print(f"\n1x load = {rate:.0f} requests/s (eager's median steady throughput)\n")
    print(
        f"{'system':<14}{'compiles':>9}{'after':>7}{'warm-up':>10}{'req/s':>9}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'calls':>7}{'mean B':>8}{'padding':>9}"
    )
    throughput = {}
    for name, system in served.items():
        counts = system.counts
        throughput[name] = statistics.median(system.throughputs)
        mean_b = statistics.mean(b for b, _ in counts.calls)
        print(
            f"{name:<14}{system.warm_compiles:>9}{counts.compiles - system.warm_compiles:>7}"
            f"{system.warm_s:>9.1f}s{throughput[name]:>9.0f}"
            f"{percentile(system.latencies, 0.50) * 1e3:>9.1f}"
            f"{percentile(system.latencies, 0.99) * 1e3:>9.1f}"
            f"{len(counts.calls):>7}{mean_b:>8.1f}{1 - system.real_tokens / counts.slots:>9.0%}"
        )
    shaped = served["shapes="]
    print()
    for label, ok in (
        ("shapes=: no compilation after warm-up", shaped.counts.compiles == shaped.warm_compiles),
        ("shapes=: throughput >= eager's", throughput["shapes="] >= throughput["eager"]),
        (
            "shapes=: throughput >= dynamic=True's",
            throughput["shapes="] >= throughput["dynamic=True"],
        ),
    ):
        print(f"{'PASS' if ok else 'MISS'}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
