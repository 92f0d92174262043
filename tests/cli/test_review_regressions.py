"""Regressions from a review of simulate, profile, memory and the command line.

Each test failed before its fix. Calls that used to hang run in a daemon thread with a
timeout, so a regression fails the test instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchkit.cli.memory as cli_memory
import batchkit.cli.simulate as cli_simulate
import batchkit.tools.simulate as sim
from batchkit.batchers import BucketedBatcher
from batchkit.cli import main
from batchkit.serve.scheduler import FormedBatch, Scheduler
from batchkit.tools.profile import profile
from batchkit.tools.simulate import LatencyModel, read_trace, simulate
from tests.cli._helpers import assert_one_line_error, run

ROOT = Path(__file__).resolve().parents[2]
TARGET = f"{Path(__file__).with_name('models.py')}:saturating"
MEMORY = ["memory", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "10"]


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result (or its exception, raised here); fails if it runs past ``seconds``."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)  # a hung one dies with the process
    thread.start()
    thread.join(seconds)
    if not box:
        pytest.fail(f"still running after {seconds} s (the hang is back)")
    ok, value = box[0]
    if not ok:
        raise value
    return value


# 1. keys travel with their arrivals when the arrivals are sorted


def test_keys_are_sorted_with_unsorted_arrivals() -> None:
    # t=0 key 5 runs alone (10 ms); t=1 ms key 6 and t=2 ms key 100 wait in different
    # buckets, so three batches of one. Pairing keys by position after sorting the times
    # put 5 and 6 together (one batch of two).
    policy = BucketedBatcher([8, 128], max_batch_size=4)
    r = simulate((10.0, 0.0), arrivals=[0.002, 0.0, 0.001], keys=[100, 5, 6], batcher=policy)
    assert r.batch_sizes == {1: 3}


# 2. an infinite batch latency: an error, never a hang


def test_profile_with_a_repeated_batch_size_is_averaged() -> None:
    model = LatencyModel.from_points([1, 8, 8], [1.0, 2.0, 3.0])
    assert model.seconds(8) == pytest.approx(2.5e-3)
    slope = (2.5 - 1.0) / 7
    assert model.seconds(16) == pytest.approx((2.5 + 8 * slope) / 1e3)


def test_simulate_with_a_duplicate_size_profile_finishes(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text(
        '{"points": [{"batch_size": 1, "latency_ms": 1.0}, {"batch_size": 8, "latency_ms": 2.0},'
        ' {"batch_size": 8, "latency_ms": 3.0}]}'
    )
    r = within(5, lambda: simulate(str(path), arrivals=np.arange(40) * 1e-4, max_batch_size=32))
    assert r.served == 40
    assert np.isfinite(r.latencies_s).all()


def test_overflowing_batch_latency_is_an_error() -> None:
    # [0] ends at 1e305 s; [1, 2] would end at infinity with [3] still waiting.
    with pytest.raises(ValueError, match=r"a batch of 2 takes inf ms"):
        within(5, lambda: simulate((5.0, 1e308), arrivals=[0, 1e-3, 2e-3, 3e-3], max_batch_size=2))


def test_requests_the_scheduler_never_dispatches_are_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stuck(Scheduler):
        def poll(self, now: float) -> tuple[FormedBatch | None, float | None]:
            return None, None

    monkeypatch.setattr(sim, "Scheduler", Stuck)
    with pytest.raises(RuntimeError, match="1 requests left waiting"):
        within(5, lambda: simulate((1.0, 0.0), arrivals=[0.0]))


# 3. max_concurrent_batches is checked by the Python API too


@pytest.mark.parametrize("slots", [0, -1, 1.5, True])
def test_simulate_rejects_bad_max_concurrent_batches(slots: Any) -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        within(5, lambda: simulate(rate=10, num_requests=5, max_concurrent_batches=slots))


# 4. an async function is awaited, on one loop for the whole run


def test_profile_awaits_an_async_function() -> None:
    loops: set[int] = set()

    async def fn(batch: np.ndarray) -> np.ndarray:
        loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0.02)
        return batch

    r = profile(fn, [2], batch_sizes=[1, 2], warmup=1, repeats=1)
    assert all(p.latency_ms >= 15 for p in r.points)  # a bare coroutine takes microseconds
    assert len(loops) == 1


def test_profile_awaits_an_awaitable_result() -> None:
    async def work(batch: np.ndarray) -> np.ndarray:
        await asyncio.sleep(0.02)
        return batch

    r = profile(lambda batch: work(batch), [2], batch_sizes=[1], warmup=0, repeats=1)
    assert r.points[0].latency_ms >= 15


def test_profile_refuses_to_await_inside_a_running_loop() -> None:
    async def fn(batch: np.ndarray) -> np.ndarray:
        return batch

    async def caller() -> None:
        profile(fn, [2], batch_sizes=[1], warmup=0, repeats=1)

    with pytest.raises(RuntimeError, match="running event loop"):
        asyncio.run(caller())


# 5. torch device/dtype and memory failures: one line, exit 2


def _cpu_only_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _cpu_only_torch(), reason="needs a torch without CUDA")
def test_profile_cuda_on_a_cpu_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        profile(lambda b: b, [2], framework="torch", device="cuda", batch_sizes=[1])
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "2",
                       "--framework", "torch", "--device", "cuda")  # fmt: skip
    assert_one_line_error(code, err, "device 'cuda' is not available")


@pytest.mark.skipif(not hasattr(np, "float128"), reason="numpy has no float128 here")
def test_profile_torch_float128(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "2", "--framework", "torch",
                       "--dtype", "float128", "--device", "cpu")  # fmt: skip
    assert_one_line_error(code, err, "dtype float128 is not supported by torch")


def test_profile_input_too_large_for_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # 10**18 elements: no machine allocates that.
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "1000000,1000000,1000000",
                       "--batch-sizes", "1")  # fmt: skip
    assert_one_line_error(code, err, "not enough memory for a batch of shape (1, 1000000")


def test_main_maps_memory_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(**_: Any) -> None:
        raise MemoryError

    monkeypatch.setattr(cli_memory, "memory_plan", no_memory)
    code, _, err = run(capsys, *MEMORY, "--layers", "2")
    assert_one_line_error(code, err, "not enough memory")


# 6. small command-line problems


def test_offered_rate_of_simultaneous_arrivals_is_undefined(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert np.isnan(simulate((1.0, 0.0), arrivals=[0.0, 0.0]).offered_rate)
    code, out, _ = run(capsys, "simulate", "--rate", "1000", "--requests", "1")
    assert code == 0
    assert "offered n/a" in out
    assert "warning" not in out


def test_int_argument_above_maxsize(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "1000", "--max-batch-size",
                       "99999999999999999999")  # fmt: skip
    assert_one_line_error(code, err, "--max-batch-size", f"up to {sys.maxsize}")


def test_requests_beyond_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*_: Any) -> None:
        raise MemoryError("Unable to allocate 7.28 TiB")

    monkeypatch.setattr(cli_simulate, "poisson_arrivals", no_memory)
    code, _, err = run(capsys, "simulate", "--rate", "1000", "--requests", "1000000000000")
    assert_one_line_error(code, err, "--requests", "not enough memory")


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


def test_broken_pipe_is_quiet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["simulate", "--rate", "1000", "--requests", "10"])
    assert code == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_broken_pipe_in_a_real_pipe(unbuffered: str) -> None:
    # The reader is gone before the command writes (as `| head -1` after its line).
    # Buffered, the write fails only when stdout is flushed: in main, not at exit.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchkit", "simulate", "--rate", "1000", "--requests", "10"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 141
    assert err == b""


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_memory_absurd_layers(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    code, _, err = run(capsys, *MEMORY, "--layers", "9" * 310, "--dtype", dtype)
    assert_one_line_error(code, err, "--layers")


@pytest.mark.parametrize(
    ("option", "text", "unit"), [("--gpu-memory", "0.5", "byte"), ("--params", "0.1", "parameter")]
)
def test_sub_unit_sizes_name_what_was_given(
    capsys: pytest.CaptureFixture[str], option: str, text: str, unit: str
) -> None:
    code, _, err = run(capsys, *MEMORY, "--layers", "2", option, text)
    assert_one_line_error(code, err, option, f"{text!r} is less than one {unit}")


def test_rate_too_low_for_finite_arrivals(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "1e-320")
    assert_one_line_error(code, err, "--rate", "too low")
    assert "RuntimeWarning" not in err


# The reviewer's note: docs/cli.md says "a CSV's first column works"; a header row did not.


def test_trace_csv_with_a_header(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("# exported\ntimestamp,len\n0.5,5\n0.1,7\n")
    assert read_trace(path).tolist() == pytest.approx([0.0, 0.4])


@pytest.mark.parametrize(
    ("text", "line"), [("0.1\ntimestamp\n", 2), ("time\nlen\n0\n", 2), ("1.2.3\n0\n", 1)]
)
def test_trace_only_a_first_header_row_is_skipped(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f":{line}: not an arrival time"):
        read_trace(path)


def test_simulated_latencies_come_in_the_order_of_the_arrivals_given() -> None:
    result = simulate(
        (1000.0, 0.0), arrivals=[0.1, 0.0], max_batch_size=1, max_concurrent_batches=1
    )  # 1 s per batch: the request at 0.0 runs first, the one at 0.1 waits for it
    assert result.latencies_s.tolist() == pytest.approx([1.9, 1.0])  # was [1.0, 1.9]
