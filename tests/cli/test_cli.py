"""The command line, in-process: output, exit codes, and one-line errors (no tracebacks)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import batchkit.cli.memory as cli_memory
import batchkit.cli.simulate as cli_simulate
from batchkit.cli import main
from tests.cli._helpers import assert_one_line_error, run

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(__file__).with_name("models.py")
LLAMA = ["memory", "--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--seq-len", "4096"]
MEMORY = ["memory", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "10"]


def test_memory_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, *LLAMA, "--gpu-memory", "80GiB", "--params", "7B", "--batch-size", "8"
    )
    assert code == 0
    assert "2.00 GiB  (4096 tokens, 2,147,483,648 bytes)" in out
    assert re.search(r"batch of 8 +16.00 GiB", out)
    assert "weights: 7B params x 2 B = 13.04 GiB" in out
    assert "largest batch: 29 sequences" in out
    assert "activations counted" not in out  # none given: the KV cache alone decides


def test_memory_says_activations_cut_the_largest_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *LLAMA, "--gpu-memory", "80GiB", "--params", "7B",
                       "--hidden-size", "4096", "--intermediate-size", "11008")  # fmt: skip
    assert code == 0
    assert "largest batch: 26 sequences" in out
    assert (
        "activations counted: each sequence also needs 236.00 MiB of peak activations; "
        "the KV cache alone would allow 29"
    ) in out


@pytest.mark.parametrize(
    ("option", "units"), [("--gpu-memory", "GiB or G"), ("--params", "B or G")]
)
def test_memory_refuses_a_bare_number_naming_the_units(
    capsys: pytest.CaptureFixture[str], option: str, units: str
) -> None:
    code, _, err = run(capsys, *LLAMA, option, "24")
    assert_one_line_error(code, err, option, "cannot read '24'", f"give a unit: {units}")


def test_memory_says_a_decimal_size_is_decimal(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *LLAMA, "--gpu-memory", "24GB", "--params", "7B")
    assert code == 0
    assert (
        "GPU memory 24GB = 24,000,000,000 bytes = 22.35 GiB "
        "(GB is decimal: 1 GB = 10^9 bytes, 1 GiB = 2^30)"
    ) in out
    code, out, _ = run(capsys, *LLAMA, "--gpu-memory", "24GiB")
    assert "GPU memory 24GiB = 25,769,803,776 bytes\n" in out


def test_memory_weights_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *LLAMA, "--gpu-memory", "8GiB", "--params", "7B")
    assert code == 1  # not 0: nothing fits (2 stays for bad arguments)
    assert (
        "the weights alone do not fit: 13.04 GiB of weights, 7.20 GiB usable after the "
        "reserve (5.84 GiB short)"
    ) in out
    assert "one 4096-token sequence needs 7.84 GiB more" in out  # was 2.00 GiB


def test_memory_no_sequence_fits_beside_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *LLAMA, "--gpu-memory", "16GiB", "--params", "7B")
    assert code == 1
    assert "do not fit" not in out  # the weights do: 1.36 GiB is left for sequences
    assert "largest batch: 0 (one 4096-token sequence needs 653.84 MiB more)" in out


def test_simulate_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "--rate", "1000", "--requests", "2000",
                       "--latency-ms", "2", "--per-item-ms", "0.25")  # fmt: skip
    assert code == 0
    for text in ("throughput", "p99.9", "batch sizes", "DynamicBatcher(max_batch_size=32"):
        assert text in out


def test_simulate_sweep_and_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.txt"
    trace.write_text("\n".join(str(i / 1000) for i in range(8)))
    code, out, _ = run(capsys, "simulate", "--trace", str(trace), "--latency-ms", "2.2",
                       "--per-item-ms", "0.5", "--max-batch-size", "2,32")  # fmt: skip
    assert code == 0
    rows = out.splitlines()[2:4]
    assert rows[0].split()[:3] == ["2", "5", "1"] and rows[1].split()[:3] == ["32", "5", "1"]


def test_simulate_sweep_says_why_rows_are_identical(capsys: pytest.CaptureFixture[str]) -> None:
    # At 500 req/s the model is always busy: every batch leaves when it frees, before
    # either wait, so both rows are the same run.
    code, out, _ = run(capsys, "simulate", "--rate", "500", "--requests", "2000",
                       "--max-wait-ms", "1,5")  # fmt: skip
    assert code == 0
    rows = out.splitlines()[2:4]
    assert all(row.endswith("  (=1)") for row in rows), rows
    assert (
        "(=1) identical figures at wait ms 1, 5: no batch waited for max wait: each left "
        "full or as soon as the model was free"
    ) in out


def test_simulate_sweep_notes_identical_rows_it_cannot_explain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One group: a limit of 1 or 2 groups per batch cannot differ, but no batch held
    # fewer than 1 group, so the runs give no reason beyond the figures.
    code, out, _ = run(capsys, "simulate", "--rate", "50", "--requests", "500", "--groups",
                       "1", "--max-groups-per-batch", "1,2")  # fmt: skip
    assert code == 0
    assert out.splitlines()[-1] == "(=1) identical figures at groups 1, 2"


def test_simulate_sweep_marks_no_row_that_differs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "--rate", "50", "--requests", "2000",
                       "--max-concurrent-batches", "1,2")  # fmt: skip
    assert code == 0
    assert "(=" not in out and "identical" not in out


def _profile_json(path: Path, *, knee_determined: bool) -> Path:
    """A ``batchkit profile --json`` file of four sizes, its knee settled or not."""
    points = [
        {"batch_size": b, "latency_ms": 2.0 + 0.5 * b, "p10_ms": 1.0, "p90_ms": 9.0}
        for b in (1, 4, 8, 16)
    ]
    knee = [8, 8] if knee_determined else [1, 16]
    path.write_text(json.dumps({"batchkit_profile": 1, "points": points, "knee_range": knee,
                                "knee_determined": knee_determined}))  # fmt: skip
    return path


def test_simulate_warns_of_a_profile_too_noisy_to_pick_a_knee(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    noisy = _profile_json(tmp_path / "noisy.json", knee_determined=False)
    code, out, _ = run(capsys, "simulate", "--profile", str(noisy), "--rate", "100",
                       "--requests", "200")  # fmt: skip
    assert code == 0
    assert (
        f"warning: {noisy}: batchkit profile found these timings too noisy to pick a knee "
        "(anywhere from 1 to 16)"
    ) in out
    settled = _profile_json(tmp_path / "settled.json", knee_determined=True)
    code, out, _ = run(capsys, "simulate", "--profile", str(settled), "--rate", "100",
                       "--requests", "200")  # fmt: skip
    assert code == 0 and "warning" not in out


def test_profile_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "p.json"
    code, out, _ = run(capsys, "profile", f"{MODELS}:saturating", "--input-shape", "16",
                       "--batch-sizes", "1,4,8,16", "--warmup", "1", "--repeats", "3",
                       "--sla-ms", "50", "--json", str(out_json))  # fmt: skip
    assert code == 0, out
    # The knee itself is checked in test_profile.py; here, that the report is complete.
    assert "<- knee" in out and "recommended for a 50 ms target: max_batch_size=" in out
    code, out, _ = run(capsys, "simulate", "--profile", str(out_json), "--rate", "500",
                       "--requests", "500")  # fmt: skip
    assert code == 0 and "profile of 4 sizes" in out


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["profile", "nomodule_xyz:f", "--input-shape", "4"], ["cannot import 'nomodule_xyz'"]),
        (["profile", "tests.cli.models:nothing", "--input-shape", "4"], ["no attribute 'nothing'"]),
        (["profile", "tests.cli.models:not_callable", "--input-shape", "4"], ["not a callable"]),
        (["profile", "no_colon", "--input-shape", "4"], ["MODULE:CALLABLE"]),
        (["profile", "missing.py:f", "--input-shape", "4"], ["no such file"]),
        (["profile", "tests.cli.models:broken", "--input-shape", "4", "--batch-sizes", "2"],
         ["shape (2, 4)", "shapes do not match"]),
        (["profile", "tests.cli.models:saturating", "--input-shape", "4", "--dtype", "float99"],
         ["unknown dtype"]),
        (["simulate", "--trace", "/nonexistent/trace.txt"], ["cannot read trace file"]),
        (["simulate", "--rate", "10", "--profile", "/nonexistent.json"], ["cannot read profile"]),
        (["simulate", "--rate", "10", "--profile", "x.json", "--latency-ms", "1"], ["not both"]),
        (["simulate", "--rate", "10", "--latency-ms", "0", "--per-item-ms", "0"], ["0 ms"]),
        (["simulate", "--rate", "10", "--policy", "static", "--no-eager"],
         ["--no-eager is for --policy dynamic"]),
        ([*LLAMA, "--dtype", "fp13"], ["unknown dtype 'fp13'"]),
        ([*LLAMA, "--intermediate-size", "10"], ["needs --hidden-size"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["simulate", "--rate", "-5"], "expected a positive number"),
        (["simulate", "--rate", "nan"], "expected a positive number"),
        (["simulate"], "one of the arguments --rate --trace is required"),
        (["simulate", "--rate", "5", "--max-batch-size", "0,4"], "positive integer"),
        (["profile", "m:f", "--input-shape", "3,x"], "shape"),
        ([*LLAMA, "--gpu-memory", "80 parsecs"], "cannot read '80 parsecs'"),
        ([*LLAMA, "--reserve", "1.5"], "fraction"),
        (["memory", "--layers", "32"], "required"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_argparse_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_plot_without_matplotlib(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = run(capsys, "profile", "tests.cli.models:saturating", "--input-shape", "4",
                           "--plot", str(tmp_path / "p.png"))  # fmt: skip
        assert_one_line_error(code, err, "matplotlib")
    else:
        code, _, _ = run(capsys, "profile", "tests.cli.models:saturating", "--input-shape", "4",
                         "--batch-sizes", "1,2", "--plot", str(tmp_path / "p.png"))  # fmt: skip
        assert code == 0 and (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("command", ["demo", "profile", "simulate", "memory"])
def test_help_shows_percent_signs_as_written(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "%%" not in out
    if command == "profile":
        assert "95% confidence interval" in out and "within 5% of the peak" in out


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "simulate" in out and "profile" in out


def test_python_m_batchkit_demo_runs() -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "batchkit", "demo", "--requests", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "@batched (bucketed)" in done.stdout and "speed-up" in done.stdout


def test_demo_without_torch_runs_the_numpy_model(tmp_path: Path) -> None:
    # A stub that makes 'import torch' fail, as on a numpy-only install.
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "batchkit", "demo", "--requests", "16", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "built-in numpy encoder" in done.stdout and "results: equal" in done.stdout
    asked = subprocess.run(
        [sys.executable, "-m", "batchkit", "demo", "--requests", "8", "--model", "torch"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert asked.returncode == 2
    assert asked.stderr.strip() == 'the torch encoder needs torch: pip install "batchkit-ml[torch]"'


def test_main_maps_memory_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(**_: Any) -> None:
        raise MemoryError

    monkeypatch.setattr(cli_memory, "memory_plan", no_memory)
    code, _, err = run(capsys, *MEMORY, "--layers", "2")
    assert_one_line_error(code, err, "not enough memory")


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
    ("option", "text", "unit"),
    [("--gpu-memory", "0.5B", "byte"), ("--params", "1e-1", "parameter")],
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


def test_profile_loads_a_file_that_defines_a_dataclass_under_postponed_annotations(
    tmp_path: Path,
) -> None:
    """A dataclass looks its module up in sys.modules while it is created; a file
    loaded by path must be registered there first (it raised AttributeError)."""
    from batchkit.cli.profile import load_callable

    model = tmp_path / "dc_model.py"
    model.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass Config:\n    scale: int = 2\n\n"
        "def predict(xs):\n    return [x * Config().scale for x in xs]\n"
    )
    fn = load_callable(f"{model}:predict")
    assert fn([1, 2]) == [2, 4]


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "batchkit", "--version"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"batchkit {version('batchkit-ml')}"
