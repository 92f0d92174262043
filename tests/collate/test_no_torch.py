"""batchkit imports and every collator works with torch absent (numpy only)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked for this test")
            return None

    sys.meta_path.insert(0, BlockTorch())
    import numpy as np
    import batchkit

    seqs = [[1, 2, 3], [4], [], [5, 6]]
    padded = batchkit.pad(seqs, side="left", pad_to_multiple_of=4)
    assert isinstance(padded.data, np.ndarray) and padded.data.shape == (4, 4)
    assert [x.tolist() for x in padded.unpad(padded.data)] == seqs
    varlen = batchkit.pack_varlen([np.asarray(s) for s in seqs], pad_to_multiple_of=8)
    assert varlen.cu_seqlens.tolist() == [0, 3, 4, 4, 6, 8]
    assert [x.tolist() for x in varlen.unpack(varlen.values)] == seqs
    for strategy in ("best_fit", "first_fit", "in_order"):
        packed = batchkit.pack(seqs, 3, strategy=strategy)
        assert [x.tolist() for x in packed.unpack(packed.data)] == seqs
    split = batchkit.pack(seqs, 2, split=True)
    assert [x.tolist() for x in split.unpack(split.data)] == seqs
    stacked = batchkit.stack([{"x": np.arange(2), "y": 1}, {"x": np.arange(2), "y": 2}])
    assert len(batchkit.unstack(stacked)) == 2
    out = batchkit.PadCollator(return_tensors="np")(
        [{"input_ids": [1, 2], "label": 0}, {"input_ids": [3], "label": 1}]
    )
    assert out["attention_mask"].tolist() == [[1, 1], [1, 0]], out
    by_default = batchkit.PadCollator()([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert all(isinstance(v, np.ndarray) for v in by_default.values()), by_default
    assert by_default["input_ids"].tolist() == [[1, 2], [3, 0]]
    with_idx = [{"input_ids": [1, 2], "idx": 4}, {"input_ids": [3], "idx": 5}]
    flat = batchkit.VarlenCollator()(with_idx)
    assert flat["idx"].tolist() == [4, 5] and isinstance(flat["input_ids"], np.ndarray)
    flat = batchkit.VarlenCollator(return_tensors="np")([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert flat["cu_seq_lens_q"].tolist() == [0, 2, 3] and flat["max_length_q"] == 2
    try:
        batchkit.pad(seqs, return_tensors="pt")
    except ImportError as exc:
        assert "torch" in str(exc)
    else:
        raise AssertionError("return_tensors='pt' should need torch")
    for needs_torch in (
        lambda: batchkit.to_device({"x": np.ones(2)}, "cpu"),
        lambda: batchkit.pad(seqs, return_tensors="pt", pin_memory=True),
    ):
        try:
            needs_torch()
        except ImportError as exc:
            assert "needs torch" in str(exc), exc
        else:
            raise AssertionError("to_device and pinning should need torch")
    try:
        batchkit.pad(seqs, pin_memory=True)
    except ValueError as exc:
        assert "pin_memory=True pins torch tensors" in str(exc), exc
    else:
        raise AssertionError("numpy output should not be pinned")
    assert "torch" not in sys.modules
    print("NO-TORCH OK")
    """
)


def test_collators_work_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "NO-TORCH OK" in result.stdout
