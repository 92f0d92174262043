"""benchmarks/bucket_turns.py: the example service's shape, simulated past capacity."""

from __future__ import annotations

from tests.benchmarks._scripts import load_script, run_script


def test_past_capacity_the_503s_are_refusals_and_the_batches_fill() -> None:
    bench = load_script("bucket_turns")
    limit = bench.device_limit(0)
    answered, dropped, size = bench.run(4.0, 0, 10.0)
    assert dropped <= 0.01  # at most 1% of the 503s came as drops after admission
    assert answered > limit  # the longest texts are the ones refused more often
    assert size > 6.0  # each turn planned at its leaving size lets the batches fill


def test_the_script_prints_a_row_per_load_beside_the_device_limit() -> None:
    done = run_script("bucket_turns", "--seeds", "1", "--seconds", "3")
    assert done.returncode == 0, done.stderr
    assert "device limit (ref):" in done.stdout
    rows = [
        line.split()[0]
        for line in done.stdout.splitlines()
        if line.strip()[:2] in {"1x", "2x", "4x"}
    ]
    assert rows == ["1x", "2x", "4x"]
