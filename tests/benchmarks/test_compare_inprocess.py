"""benchmarks/compare_inprocess.py: a revision loaded under another package name is a
separate, working batchkit (its own modules, its own imports), beside this one."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import batchkit
from tests.benchmarks._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_tree_loaded_under_another_name_serves_with_its_own_modules(tmp_path: Path) -> None:
    script = load_script("compare_inprocess")
    copy = script.load_as(ROOT, "batchkit_copy_for_test", tmp_path)
    try:
        core = sys.modules["batchkit_copy_for_test.serve.core"]
        assert core is not sys.modules["batchkit.serve.core"]
        double = copy.batched(max_batch_size=4)(lambda xs: [2 * x for x in xs])
        try:
            assert [double(i) for i in range(3)] == [0, 2, 4]
        finally:
            double.close()
        for path in (tmp_path / "batchkit_copy_for_test").rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(from|import) batchkit\b", text, re.MULTILINE), path
        assert batchkit.batched is not copy.batched
    finally:
        for name in [n for n in sys.modules if n.startswith("batchkit_copy_for_test")]:
            del sys.modules[name]
        sys.path.remove(str(tmp_path))
