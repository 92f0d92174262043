"""benchmarks/stream.py: its quickest run (batchkit rows only, no Ray) prints its table
and exits cleanly; a caller given the wrong chunks is caught, naming the item."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmarks._scripts import load_script, run_script


def test_quickest_run_of_the_batchkit_rows_prints_the_table() -> None:
    done = run_script("stream", "--quick", "--repeats", "1", "--systems", "batchkit,batchkit-sync")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("system "))
    legend = next(i for i, line in enumerate(lines) if line.startswith("(batch: "))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : legend]}
    assert list(rows) == ["batchkit", "batchkit-sync", "device"], lines[header:legend]
    for name in ("batchkit", "batchkit-sync"):
        # chunks/s, of bound, batch, then the half-load columns: all numbers
        cells = [cell for cell in rows[name][1:] if not cell.startswith("[")]
        assert len(cells) == 8, rows[name]
        assert all(float(cell) > 0 for cell in cells), rows[name]
    assert any(line.startswith("info  the goals compare with ray-serve") for line in lines)


def test_unknown_system_is_refused_by_name() -> None:
    done = run_script("stream", "--systems", "batchkit,triton")
    assert done.returncode == 2
    assert "unknown systems: ['triton']" in done.stderr


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("stream", "stream_bench_under_test")


def test_a_stream_with_a_missing_or_foreign_chunk_is_caught(script: ModuleType) -> None:
    item = (7, 3)
    script.verify("sys", item, [(7, 0), (7, 1), (7, 2)])  # exactly its chunks: fine
    with pytest.raises(script.WrongChunks, match=r"sys: item 7 \(k=3\) received 2 chunks"):
        script.verify("sys", item, [(7, 0), (7, 1)])
    with pytest.raises(script.WrongChunks, match="first difference at chunk 1"):
        script.verify("sys", item, [(7, 0), (8, 1), (7, 2)])


def test_each_step_gives_an_item_its_chunk_until_it_has_k_then_the_end(
    script: ModuleType,
) -> None:
    items = [(0, 1), (1, 3)]
    steps = list(script.sync_generator(items))
    end = script.batchkit.END
    assert steps == [[(0, 0), (1, 0)], [end, (1, 1)], [end, (1, 2)]]
