"""memory: numbers against hand calculations."""

from __future__ import annotations

from math import ceil

import pytest

from batchkit.tools.memory import (
    activation_bytes,
    kv_cache_bytes,
    memory_plan,
    parse_bytes,
    parse_count,
)

GiB = 2**30
LLAMA2_7B = {"layers": 32, "kv_heads": 32, "head_dim": 128}


def test_llama2_7b_is_2_gib_per_4096_token_sequence() -> None:
    # 2 (K, V) x 32 layers x 32 heads x 128 dims x 2 bytes = 512 KiB per token.
    assert kv_cache_bytes(**LLAMA2_7B, seq_len=1) == 512 * 1024
    assert kv_cache_bytes(**LLAMA2_7B, seq_len=4096) == 2 * GiB
    assert kv_cache_bytes(**LLAMA2_7B, seq_len=4096, batch_size=8, dtype="fp32") == 32 * GiB


def test_gqa_and_small_dtypes() -> None:
    # Llama-3-70B: 80 layers, 8 KV heads of 128: 2*80*8*128*2 = 320 KiB per token in fp16.
    assert kv_cache_bytes(layers=80, kv_heads=8, head_dim=128, seq_len=1) == 320 * 1024
    assert kv_cache_bytes(layers=80, kv_heads=8, head_dim=128, seq_len=1, dtype="fp8") == 160 * 1024
    assert kv_cache_bytes(layers=1, kv_heads=1, head_dim=3, seq_len=1, dtype="int4") == 3


def test_largest_batch_on_80_gib() -> None:
    plan = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="80GiB", params="7B", reserve=0.1)
    assert plan.weight_bytes == 14 * 10**9
    assert plan.reserved_bytes == 8 * GiB
    assert plan.available_bytes == 72 * GiB - 14 * 10**9
    assert plan.max_batch_size == (72 * GiB - 14 * 10**9) // (2 * GiB) == 29
    assert memory_plan(**LLAMA2_7B, seq_len=4096).max_batch_size is None


def test_activations_count_per_sequence() -> None:
    # (2 * 4096 + 2 * 11008) values per token, 2 bytes, 4096 tokens.
    act = activation_bytes(seq_len=4096, hidden_size=4096, intermediate_size=11008)
    assert act == (2 * 4096 + 2 * 11008) * 2 * 4096
    plan = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="80GiB", params="7B",
                       hidden_size=4096, intermediate_size=11008)  # fmt: skip
    assert plan.max_batch_size == plan.available_bytes // (2 * GiB + act) == 26  # type: ignore[operator]


def test_weights_alone_overflow() -> None:
    plan = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="24GB", params="70B")
    assert plan.max_batch_size == 0 and plan.available_bytes is not None
    assert plan.available_bytes < 0
    assert plan.weights_fit is False


def test_shortfall_counts_the_weights_overflow() -> None:
    # 7B fp16 on 8 GiB: 14e9 B of weights, 8 GiB - 0.8 GiB usable: 5.84 GiB short before
    # any sequence, so one 2 GiB sequence needs 7.84 GiB more (not 2 GiB: the overflow
    # used to be clamped to zero).
    plan = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="8GiB", params="7B")
    overflow = 14 * 10**9 - (8 * GiB - plan.reserved_bytes)
    assert plan.reserved_bytes == ceil(0.8 * GiB)
    assert plan.available_bytes == -overflow
    assert plan.weights_fit is False
    assert plan.shortfall_bytes == 2 * GiB + overflow
    assert round(plan.shortfall_bytes / GiB, 2) == 7.84


def test_shortfall_when_the_weights_fit() -> None:
    # 16 GiB: 14.4 GiB usable, 1.36 GiB left after the weights; a sequence needs 2 GiB.
    tight = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="16GiB", params="7B")
    assert tight.weights_fit is True and tight.max_batch_size == 0
    assert tight.shortfall_bytes == 2 * GiB - tight.available_bytes  # type: ignore[operator]
    roomy = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="80GiB", params="7B")
    assert roomy.weights_fit is True and roomy.shortfall_bytes == 0
    no_gpu = memory_plan(**LLAMA2_7B, seq_len=4096, params="7B")
    assert no_gpu.weights_fit is None and no_gpu.shortfall_bytes is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GiB", 80 * GiB), ("80G", 80 * GiB), ("80GB", 80 * 10**9), ("1.5 TiB", 3 * 2**39),
     ("4096B", 4096), ("2.4e10", 24 * 10**9), ("512mib", 512 * 2**20)],
)  # fmt: skip
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "value"), [("7B", 7 * 10**9), ("7e9", 7 * 10**9), ("125M", 125 * 10**6)]
)
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["24", "4096", "0.5", " 80 "])
def test_a_size_without_a_unit_is_refused_naming_the_units(text: str) -> None:
    with pytest.raises(ValueError, match=r"give a unit: GiB or G \(binary, 2\^30 bytes\), GB "):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["7", "125", "70.5"])
def test_a_count_without_a_suffix_is_refused_naming_the_suffixes(text: str) -> None:
    with pytest.raises(ValueError, match=r"give a unit: B or G \(10\^9\), M"):
        parse_count(text)


def test_a_gpu_memory_in_text_needs_a_unit_but_a_number_is_bytes() -> None:
    with pytest.raises(ValueError, match="give a unit"):
        memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory="80")
    with pytest.raises(ValueError, match="give a unit"):
        memory_plan(**LLAMA2_7B, seq_len=4096, params="7")
    assert memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory=80 * GiB).gpu_bytes == 80 * GiB


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GB", "nan", "1e999GB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes(text)


def test_bad_model_numbers() -> None:
    with pytest.raises(ValueError, match="layers"):
        kv_cache_bytes(layers=0, kv_heads=1, head_dim=1, seq_len=1)
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_cache_bytes(layers=1, kv_heads=1, head_dim=1, seq_len=1, dtype="fp13")
    with pytest.raises(ValueError, match="reserve"):
        memory_plan(**LLAMA2_7B, seq_len=1, reserve=1.0)


def test_counts_beyond_a_floats_range_are_exact() -> None:
    """Integers past 1e308 are valid sizes: the arithmetic stays in integers and
    fractions (it used to raise OverflowError converting them to float)."""
    huge = 10**400
    plan = memory_plan(**LLAMA2_7B, seq_len=4096, gpu_memory=huge, reserve=0.1)
    assert plan.reserved_bytes == huge // 10
    assert plan.max_batch_size == (huge - huge // 10) // (2 * GiB)
    assert kv_cache_bytes(layers=1, kv_heads=1, head_dim=1, seq_len=huge, dtype="int4") == huge
    none_fit = memory_plan(**LLAMA2_7B, seq_len=1, gpu_memory=80 * GiB, params=huge)
    assert none_fit.weight_bytes == 2 * huge and none_fit.max_batch_size == 0


def test_numpy_and_decimal_inputs_give_python_ints() -> None:
    """Sizes from numpy or Decimal arithmetic are accepted, and the plan holds plain ints
    (JSON-serialisable), as with Python ints."""
    import json
    from decimal import Decimal

    import numpy as np

    kv = kv_cache_bytes(layers=np.int64(32), kv_heads=32, head_dim=128, seq_len=4096)
    assert type(kv) is int and kv == 2 * GiB
    plan = memory_plan(
        **LLAMA2_7B, seq_len=4096, gpu_memory=np.float32(80 * 2**30), params=np.float32(7e9),
        reserve=Decimal("0.1"),
    )  # fmt: skip
    assert plan.reserved_bytes == 8 * GiB and plan.max_batch_size == 29
    json.dumps(plan.__dict__)  # every field a plain int
