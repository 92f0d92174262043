"""``continuous_batcher``: a ContinuousBatcher around a Hugging Face causal LM, wired and sized."""

from __future__ import annotations

from typing import Any

from batchkit.generate.batcher import ContinuousBatcher
from batchkit.integrations.transformers.paged_lm import (
    PagedLM,
    check_model,
    kv_geometry,
    max_positions,
)
from batchkit.kv.block_table import blocks_for
from batchkit.kv.memory import num_blocks_for

#: The KV memory the default pool stays within, unless one sequence at full length
#: needs more (then the pool holds exactly that one).
DEFAULT_KV_BYTES = 1 << 30


class _FromModel:
    """The default of ``eos_token_id``: the model's ``generation_config``."""

    def __repr__(self) -> str:
        return "<from model.generation_config>"


FROM_MODEL: Any = _FromModel()


def default_num_blocks(
    model: Any, *, max_num_seqs: int, block_size: int, max_model_len: int | None = None
) -> int:
    """The pool size ``num_blocks=None`` picks: ``max_num_seqs`` sequences at full length,
    within [`DEFAULT_KV_BYTES`][batchkit.integrations.transformers.DEFAULT_KV_BYTES].

    Full length is ``max_model_len`` (default: the model's position embeddings, else
    4096 tokens). The pool is ``max_num_seqs * ceil(full length / block_size)`` blocks,
    cut to what 1 GiB of keys and values holds at the model's dtype, but never below
    one sequence at full length (so that no request is refused for the pool's sake).
    For a bigger pool, compute blocks from your memory (``batchkit memory``, or
    [`num_blocks_for`][batchkit.kv.num_blocks_for]) and pass ``num_blocks``.

    Args:
        model: The transformers causal LM.
        max_num_seqs: Sequences one step may run.
        block_size: Tokens per block.
        max_model_len: Tokens per sequence at most; ``None``: the model's positions.

    Returns:
        A number of blocks (>= 1).

    Raises:
        ValueError: Its config does not say its layers and heads.
    """
    layers, kv_heads, head_dim = kv_geometry(model.config)
    longest = max_model_len or max_positions(model.config) or 4096
    one = blocks_for(longest, block_size)
    fit = num_blocks_for(
        DEFAULT_KV_BYTES, block_size=block_size, num_layers=layers, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=model.dtype,
    )  # fmt: skip
    return max(one, min(max_num_seqs * one, fit))


def continuous_batcher(
    model: Any,
    *,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    num_blocks: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_prefill_chunk: int | None = None,
    eos_token_id: Any = FROM_MODEL,
    max_model_len: int | None = None,
    **options: Any,
) -> ContinuousBatcher:
    """A [`ContinuousBatcher`][batchkit.ContinuousBatcher] that generates with ``model``.

    Each step is one forward pass of the model over every scheduled token, through a
    [`PagedLM`][batchkit.integrations.transformers.PagedLM] over a KV pool of
    ``num_blocks`` blocks. Greedy requests generate what ``model.generate(prompt,
    do_sample=False)`` generates for their prompt alone; ``submit(...,
    sampling=Sampling(...))`` samples.

    Args:
        model: A transformers causal LM in eval mode (see ``PagedLM``).
        max_num_seqs: Sequences one step may run at most.
        max_num_batched_tokens: Tokens one step may compute at most (the token budget).
        num_blocks: KV blocks in the pool; ``None``: sized by
            [`default_num_blocks`][batchkit.integrations.transformers.default_num_blocks].
        block_size: Tokens per block.
        prefix_caching: Share the blocks of common prompt prefixes between requests.
        max_prefill_chunk: The most prompt tokens of one sequence per step (``None``:
            the whole budget).
        eos_token_id: The token (or tokens) ending every request; by default the
            model's ``generation_config.eos_token_id``; ``None``: none.
        max_model_len: Tokens per sequence at most (prompt and generated); ``None``:
            the model's position embeddings. A prompt that leaves no room is refused
            at ``submit`` (``ValueError``).
        **options: Any other [`ContinuousBatcher`][batchkit.ContinuousBatcher] option
            (``max_queue_size``, ``max_groups_per_step``, ``name``, ``clock``).

    Returns:
        The batcher; ``batcher.step_fn`` is the ``PagedLM``.

    Raises:
        TypeError: ``model`` is not a transformers model, or an unknown option.
        ValueError: A model ``PagedLM`` refuses, ``max_model_len`` beyond the model's
            positions, or a bad limit.
    """
    check_model(model)  # before sizing: the sizing reads the config of a decoder
    positions = max_positions(model.config)
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {positions} positions")
    max_model_len = max_model_len or positions
    if num_blocks is None:
        num_blocks = default_num_blocks(
            model, max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len
        )
    step = PagedLM(
        model, num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching
    )
    if eos_token_id is FROM_MODEL:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    options.setdefault("name", type(model).__name__)
    return ContinuousBatcher(
        step,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        allocator=step.allocator,
        eos_token_id=eos_token_id,
        max_model_len=max_model_len,
        max_prefill_chunk=max_prefill_chunk,
        **options,
    )
