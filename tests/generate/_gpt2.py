"""A tiny randomly initialised GPT-2 run step by step through the reference paged attention.

The step function reuses the model's own modules (embeddings, layer norms, projections,
MLP, LM head) and replaces only attention by :func:`batchkit.kv.paged_attention` over a
paged cache, so its greedy tokens must equal ``model.generate`` on each prompt alone.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from batchkit.generate import StepBatch
from batchkit.kv import paged_attention, write_kv


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=97, n_positions=128, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(torch.float64).eval()


class PagedGPT2:
    """``step_fn`` for :class:`~batchkit.ContinuousBatcher` in paged mode."""

    def __init__(self, model: GPT2LMHeadModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        shape = (num_blocks, block_size, self.heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=torch.float64) for _ in range(cfg.n_layer)]
        self.v_cache = [torch.zeros(shape, dtype=torch.float64) for _ in range(cfg.n_layer)]

    @torch.no_grad()
    def __call__(self, batch: StepBatch) -> list[int | None]:
        layout = batch.layout.to_torch()
        tr = self.model.transformer
        x = tr.wte(layout.input_ids) + tr.wpe(layout.positions)  # [T, E]
        t = x.shape[0]
        for layer, block in enumerate(tr.h):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(x.shape[-1], dim=-1)
            q, k, v = (a.view(t, self.heads, self.head_dim) for a in (q, k, v))
            write_kv(self.k_cache[layer], self.v_cache[layer], k, v, layout.slot_mapping)
            attn = paged_attention(q, self.k_cache[layer], self.v_cache[layer], layout)
            x = x + block.attn.c_proj(attn.reshape(t, -1))
            x = x + block.mlp(block.ln_2(x))
        logits = self.model.lm_head(tr.ln_f(x[layout.logits_indices]))
        next_ids = logits.argmax(dim=-1).tolist()
        return [tok if s.sample else None for tok, s in zip(next_ids, batch.seqs)]
