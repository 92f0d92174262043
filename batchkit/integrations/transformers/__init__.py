"""Continuous batching for any Hugging Face causal LM (``pip install transformers``).

- [`continuous_batcher`][batchkit.integrations.transformers.continuous_batcher]: a
  [`ContinuousBatcher`][batchkit.ContinuousBatcher] around a model, with its KV pool
  sized and its eos read from the model.
- [`PagedLM`][batchkit.integrations.transformers.PagedLM]: the step function alone
  (one packed forward pass per step over batchkit's paged pool), with ``.allocator``.
- [`packed_paged_attention`][batchkit.integrations.transformers.packed_paged_attention]:
  attention over a whole step's sequences at once, from the pool, for step functions
  written by hand.
"""

from batchkit.integrations.transformers.attention import (
    AttentionGroup,
    StepPlan,
    by_length,
    packed_paged_attention,
    plan_step,
    write_step_kv,
)
from batchkit.integrations.transformers.batcher import (
    DEFAULT_KV_BYTES,
    continuous_batcher,
    default_num_blocks,
)
from batchkit.integrations.transformers.paged_lm import PagedLM, check_model

__all__ = [
    "DEFAULT_KV_BYTES",
    "AttentionGroup",
    "PagedLM",
    "StepPlan",
    "by_length",
    "check_model",
    "continuous_batcher",
    "default_num_blocks",
    "packed_paged_attention",
    "plan_step",
    "write_step_kv",
]
