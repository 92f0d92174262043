"""The packed paged attention (every sequence of a step at once) equals batchkit's reference
paged attention (one sequence at a time) on any step: decodes, chunks from any start,
grouped-query heads, blocks scattered through the pool, and every slot that holds none
of the step's keys NaN (what a poisoned request left behind reaches nobody else)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from batchkit.integrations.transformers import (  # noqa: E402
    by_length,
    packed_paged_attention,
    plan_step,
    write_step_kv,
)
from batchkit.kv import build_layout, paged_attention, write_kv  # noqa: E402

BLOCK = 4
NUM_BLOCKS = 40

chunks = st.lists(
    st.tuples(st.integers(0, 20), st.integers(1, 9)),  # (start, num_tokens)
    min_size=1,
    max_size=6,
)


@settings(max_examples=40)
@given(
    min_saved=st.sampled_from([0, 2048]),  # 0: decodes split into groups by length
    chunks=chunks,
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 99),
)
def test_packed_attention_equals_the_reference_on_any_step(
    min_saved: int, chunks: list[tuple[int, int]], kv_heads: int, group: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    heads, dim = kv_heads * group, 8
    need = [-(-(s + n) // BLOCK) for s, n in chunks]
    if sum(need) > NUM_BLOCKS:
        return
    free = rng.permutation(NUM_BLOCKS).tolist()  # blocks scattered through the pool
    block_ids = [[free.pop() for _ in range(k)] for k in need]
    tokens = [list(range(s + n)) for s, n in chunks]
    layout = build_layout(tokens, [s for s, _ in chunks], [n for _, n in chunks], block_ids, BLOCK)
    shape = (NUM_BLOCKS, BLOCK, kv_heads, dim)
    k_cache = torch.tensor(rng.normal(size=shape))  # the earlier tokens' keys: any values
    v_cache = torch.tensor(rng.normal(size=shape))
    keys = np.zeros(NUM_BLOCKS * BLOCK, dtype=bool)  # the slots holding the step's keys
    for blocks, (start, n) in zip(block_ids, chunks):
        position = np.arange(start + n)
        keys[np.asarray(blocks)[position // BLOCK] * BLOCK + position % BLOCK] = True
    for cache in (k_cache, v_cache):  # any other slot: stale, and poisoned
        cache.view(NUM_BLOCKS * BLOCK, kv_heads, dim)[torch.from_numpy(~keys)] = float("nan")
    t = layout.num_tokens
    q = torch.tensor(rng.normal(size=(t, heads, dim)))
    k = torch.tensor(rng.normal(size=(t, kv_heads, dim)))
    v = torch.tensor(rng.normal(size=(t, kv_heads, dim)))

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(ref_k, ref_v, k, v, torch.from_numpy(layout.slot_mapping))
    want = paged_attention(q, ref_k, ref_v, layout.to_torch(), scale=0.3)

    plan = plan_step(layout, BLOCK, min_saved_keys=min_saved)
    write_step_kv(k_cache, v_cache, k, v, plan)
    for cache, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)
    got = packed_paged_attention(q, k_cache, v_cache, plan, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_heads_that_are_not_a_multiple_of_the_kv_heads_are_refused() -> None:
    layout = build_layout([[1, 2]], [0], [2], [[0]], BLOCK)
    plan = plan_step(layout, BLOCK)
    cache = torch.zeros(2, BLOCK, 2, 8)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        packed_paged_attention(torch.zeros(2, 3, 8), cache, cache, plan)


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(1, 600), max_size=40), min_saved=st.sampled_from([0, 512]))
def test_decodes_are_grouped_by_length_padding_fewer_keys(
    lengths: list[int], min_saved: int
) -> None:
    lens = np.array(lengths, dtype=np.int64)
    members = np.arange(100, 100 + len(lens))
    groups = by_length(members, lens, min_saved=min_saved)
    assert 1 <= len(groups) <= 4
    assert sorted(np.concatenate(groups).tolist()) == members.tolist()
    padded = sum(len(g) * int(lens[g - 100].max(initial=0)) for g in groups)
    assert padded <= len(lens) * int(lens.max(initial=0))
    if len(groups) > 1:  # each cut saved its share
        assert len(lens) * int(lens.max()) - padded >= min_saved


def test_long_tailed_decodes_get_their_own_groups() -> None:
    lens = np.array([20] * 24 + [480] * 8)
    groups = by_length(np.arange(32), lens)
    assert [sorted(lens[g].tolist()) for g in groups] == [[20] * 24, [480] * 8]
