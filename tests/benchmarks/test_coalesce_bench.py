"""benchmarks/coalesce.py: its workload repeats keys within blocks only, the device
counts rows and the requests that find their key in flight, and a short run prints
every system and the goal lines."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from tests.benchmarks._scripts import load_script, run_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("coalesce", "coalesce_bench_under_test")


def test_keys_repeat_within_their_block_only(bench: ModuleType) -> None:
    keys = bench.zipf_keys(random.Random(1), 4 * bench.BLOCK)
    blocks = {block for block, _ in keys}
    assert blocks == {0, 1, 2, 3}
    assert all(block == i // bench.BLOCK for i, (block, _) in enumerate(keys))
    assert 0.15 < 1 - len(set(keys)) / len(keys) < 0.45  # about 30% repeats
    unique = bench.zipf_keys(random.Random(1), 100, unique=True)
    assert len(set(unique)) == 100


def test_the_device_counts_rows_and_repeats_in_flight(bench: ModuleType) -> None:
    device = bench.Device(0.0, 0.0)
    for key in [(0, 1), (0, 1), (0, 2)]:
        device.arrived(key)
    assert device([(0, 1), (0, 2)]) == [bench.answer((0, 1)), bench.answer((0, 2))]
    device.arrived((0, 1))  # computed already: no longer in flight
    assert (device.rows, device.repeats) == (2, 1)


def test_a_short_run_prints_every_system_and_the_goals() -> None:
    done = run_script("coalesce", "--requests", "400", "--repeats", "1")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), done.stderr  # 1: a goal missed (a short, noisy run)
    out = done.stdout
    for system in ("plain", "coalesce", "lru_cache", "coalesce+lru"):
        assert f"\n{system} " in out
    assert out.count("PASS") + out.count("MISS") == 4
    assert "PASS  coalesce: device rows = distinct keys in flight" in out
