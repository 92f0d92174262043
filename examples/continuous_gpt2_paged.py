"""A tiny GPT-2 (random weights, no download) served with paged KV blocks.

The step function runs the model's own modules and swaps attention for batchkit's
reference paged attention: each step writes the new keys/values at
``layout.slot_mapping`` and reads each sequence's history through
``layout.block_tables``. The KV pool is deliberately small, so sequences are
preempted and recomputed; prefix caching shares the blocks of a common system
prompt. ``max_prefill_chunk`` splits every prompt into chunks of at most 8 tokens, so
prefills of several sequences share each step; an urgent request (``priority=-1``)
preempts the least urgent running sequence to start at once. The batcher is tracked
by a Prometheus exporter (``pip install "batchkit-ml[metrics]"``). Greedy outputs equal
``model.generate`` on each prompt alone (checked).

Run: python examples/continuous_gpt2_paged.py
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry
from transformers import GPT2Config, GPT2LMHeadModel

from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.kv import BlockAllocator, kv_block_bytes, paged_attention, write_kv
from batchkit.metrics import PrometheusMetrics

torch.manual_seed(0)
config = GPT2Config(vocab_size=97, n_positions=128, n_embd=32, n_layer=2, n_head=4)
model = GPT2LMHeadModel(config).to(torch.float64).eval()
HEADS, HEAD_DIM = config.n_head, config.n_embd // config.n_head

alloc = BlockAllocator(num_blocks=16, block_size=4, prefix_caching=True)
shape = (alloc.num_blocks, alloc.block_size, HEADS, HEAD_DIM)
k_cache = [torch.zeros(shape, dtype=torch.float64) for _ in range(config.n_layer)]
v_cache = [torch.zeros(shape, dtype=torch.float64) for _ in range(config.n_layer)]


@torch.no_grad()
def step(batch: StepBatch) -> list[int | None]:
    layout = batch.layout.to_torch()  # input_ids, positions, slot_mapping, block_tables...
    tr = model.transformer
    x = tr.wte(layout.input_ids) + tr.wpe(layout.positions)  # [T, E]: all chunks, packed
    t = x.shape[0]
    for layer, block in enumerate(tr.h):
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(config.n_embd, dim=-1)
        q, k, v = (a.view(t, HEADS, HEAD_DIM) for a in (q, k, v))
        write_kv(k_cache[layer], v_cache[layer], k, v, layout.slot_mapping)
        attn = paged_attention(q, k_cache[layer], v_cache[layer], layout)
        x = x + block.attn.c_proj(attn.reshape(t, -1))
        x = x + block.mlp(block.ln_2(x))
    logits = model.lm_head(tr.ln_f(x[layout.logits_indices]))  # one row per sequence
    return [tok if s.sample else None for tok, s in zip(logits.argmax(-1).tolist(), batch.seqs)]


def greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


system = [5, 17, 42, 8, 9, 33, 21, 2]  # a shared "system prompt": two full blocks
prompts = [system + [10 + i, 20 + i, 30 + i][: 1 + i % 3] for i in range(8)]
urgent_prompt = [60, 61, 62, 63, 64]
metrics = PrometheusMetrics(CollectorRegistry())  # or the default registry, for /metrics
with ContinuousBatcher(
    step,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    max_prefill_chunk=8,  # at most 8 prompt tokens of one sequence per step
    allocator=alloc,
    name="gpt2",
) as batcher:
    metrics.track(batcher)  # series labelled batcher="gpt2"
    handles = [batcher.submit(p, max_new_tokens=20) for p in prompts]
    urgent = batcher.submit(urgent_prompt, max_new_tokens=6, priority=-1)  # more urgent than 0
    outputs = [h.result(timeout=120) for h in handles]
    urgent_output = urgent.result(timeout=120)
    stats = batcher.stats()

for prompt, out in zip(prompts, outputs):
    assert out == greedy(prompt, 20), (out, prompt)
assert urgent_output == greedy(urgent_prompt, 6)

exposition = metrics.generate_latest().decode()
series = [
    line
    for line in exposition.splitlines()
    if line.startswith(("generation_requests_total", "generation_preemptions_total"))
    or line.startswith("generation_time_to_first_token_seconds_count")
]
print("\n".join(series))
per_block = kv_block_bytes(
    4, num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float64
)
print(
    f"8 prompts and an urgent one equal model.generate; {stats.steps} steps, "
    f"{stats.preemptions} preemptions, "
    f"prefix hit rate {stats.prefix_hit_rate:.0%}, KV waste {stats.mean_kv_waste:.1%}, "
    f"{alloc.num_blocks} blocks x {per_block} bytes"
)
