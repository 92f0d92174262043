"""``PagedLM``: a Hugging Face causal LM as a paged step function for ``ContinuousBatcher``.

Each step is one forward pass of the model's own modules over the step's packed
tokens (``[1, T]``, each token with its own position). Attention is the only part
replaced, and only for this model: the adapter registers an attention function
under a name of its own in transformers' ``AttentionInterface`` and sets that name on
this model's config. While the adapter runs a step (on its own thread), that function
writes the step's keys and values to batchkit's paged pool and attends over the
pool for every sequence at once
([`packed_paged_attention`][batchkit.integrations.transformers.packed_paged_attention]);
any other call (``model.generate`` from another thread, say) goes to the
implementation the model had before. Two adapters over two models never see each
other's steps.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from batchkit.generate.sampling import next_tokens
from batchkit.generate.sequence import StepBatch
from batchkit.integrations.transformers.attention import (
    StepPlan,
    packed_paged_attention,
    plan_step,
    write_step_kv,
)
from batchkit.kv.allocator import BlockAllocator
from batchkit.kv.memory import kv_block_bytes

# The implementation each adapter's attention name stands in for, so that a second
# adapter over the same model falls back to the real one, not to the first adapter.
_STANDS_IN_FOR: dict[str, str] = {}
_names = itertools.count()


class PagedLM:
    """The step function of a Hugging Face causal LM over a paged KV pool.

    Pass it, with its ``allocator``, to [`ContinuousBatcher`][batchkit.ContinuousBatcher]
    (or use [`continuous_batcher`][batchkit.integrations.transformers.continuous_batcher],
    which sizes and wires everything). Each step returns the next token of every
    sequence that reaches its last token: greedy, or drawn by the request's
    [`Sampling`][batchkit.generate.Sampling].

    Args:
        model: A transformers causal LM (``...ForCausalLM``, ``GPT2LMHeadModel``) in
            eval mode whose attention goes through transformers' attention interface
            (Llama, Qwen2, GPT-2, Mistral and most decoder-only families).
        num_blocks: KV blocks in the pool (a positive int).
        block_size: Tokens per block.
        prefix_caching: Share the blocks of common prompt prefixes between requests.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: ``model`` is not a causal LM, is in training mode, or has an
            attention this adapter cannot drive (sliding windows, soft-capped
            logits, cross-attention, non-attention layers, or an attention outside
            transformers' interface); or a bad pool size. (Attention sinks, which no
            config flag announces, fail the first step instead, with a ValueError.)
    """

    def __init__(
        self, model: Any, *, num_blocks: int, block_size: int = 16, prefix_caching: bool = True
    ) -> None:
        check_model(model)
        config = model.config
        self.model = model
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(config)
        self.max_model_len: int | None = max_positions(config)
        self.device = model.device
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = [
            torch.zeros(shape, dtype=model.dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self._local = threading.local()  # .plan: the step this thread is running, if any
        self.attn_implementation = self._register(config)

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block takes (keys and values, every layer)."""
        return kv_block_bytes(
            self.allocator.block_size, num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.model.dtype,
        )  # fmt: skip

    @torch.inference_mode()
    def __call__(self, batch: StepBatch) -> list[int | ValueError | None]:
        """Compute one step: one forward pass over every sequence's tokens.

        Args:
            batch: The step (paged mode: ``batch.layout`` is read).

        Returns:
            The next token of each sequence that samples (a ``ValueError`` where its
            logits are not finite: that request fails alone), ``None`` for the others.
        """
        layout = batch.layout
        device = self.device
        plan = plan_step(layout, self.allocator.block_size, device)
        sampling = [s.sample for s in batch.seqs]
        ids = torch.from_numpy(layout.input_ids).to(device)
        pos = torch.from_numpy(layout.positions).to(device)
        # logits only where a sequence samples (a mid-prompt chunk needs none)
        keep = torch.from_numpy(layout.logits_indices[np.asarray(sampling, dtype=bool)]).to(device)
        self._local.plan = plan
        try:
            out = self.model(
                input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep
            )
        finally:
            self._local.plan = None
        samplers = [s.sampler for s in batch.seqs if s.sample]
        tokens = iter(next_tokens(out.logits[0], samplers))
        return [next(tokens) if sample else None for sample in sampling]

    # -- attention ------------------------------------------------------------------
    def _register(self, config: Any) -> str:
        """Register this adapter's attention (and mask) function under a new name and
        set that name on this model's config; returns the name."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        current = config._attn_implementation or "eager"
        base = _STANDS_IN_FOR.get(current, current)
        name = f"batchkit_{next(_names)}"
        ref = weakref.ref(self)  # the registry is global: it must not keep the pool alive

        def active_plan() -> StepPlan | None:
            lm = ref()
            return None if lm is None else getattr(lm._local, "plan", None)

        def attention(
            module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
            scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
        ) -> tuple[Any, Any]:  # fmt: skip
            plan = active_plan()
            if plan is None:  # not this adapter's step: the model's own attention
                fallback = _implementation(base, module)
                return fallback(  # type: ignore[no-any-return]
                    module, query, key, value, attention_mask,
                    scaling=scaling, dropout=dropout, **kwargs,
                )  # fmt: skip
            lm = ref()
            if lm is None:  # (a plan is set only while the adapter runs a step)
                raise RuntimeError("the paged adapter was collected during its own step")
            return lm._attend(module, query, key, value, plan, scaling, kwargs), None

        ALL_ATTENTION_FUNCTIONS.register(name, attention)
        base_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
        if base_mask is not None:
            # Without a mask function of its own, a name outside transformers' table gets
            # no mask at all: right for the packed step, wrong for a padded generate().
            def mask(*args: Any, **kwargs: Any) -> Any:
                if active_plan() is not None:
                    return None
                return base_mask(*args, **kwargs)  # type: ignore[operator]

            ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
        _STANDS_IN_FOR[name] = base
        config._attn_implementation = name
        return name

    def _attend(
        self, module: Any, query: Any, key: Any, value: Any, plan: StepPlan,
        scaling: float | None, kwargs: dict[str, Any],
    ) -> torch.Tensor:  # fmt: skip
        """One layer of the step: write its keys/values to the pool, attend over it.

        ``query`` is ``[1, heads, T, D]`` and ``key``/``value`` ``[1, kv_heads, T, D]``
        (transformers' layout); returns ``[1, T, heads, D]``, what the module expects.
        """
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise ValueError("paged attention: sliding windows and soft-capping are not supported")
        if getattr(module, "sinks", None) is not None:
            raise ValueError("paged attention: attention sinks are not supported")
        layer = int(module.layer_idx)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, D]
        if tuple(k.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"layer {layer} makes keys of {tuple(k.shape[1:])} (kv heads, head dim); "
                f"the pool was sized from the config as {(self.num_kv_heads, self.head_dim)}"
            )
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        write_step_kv(k_cache, v_cache, k, v, plan)
        q = query[0].transpose(0, 1)  # [T, heads, D]
        return packed_paged_attention(q, k_cache, v_cache, plan, scale=scaling)[None]


def _implementation(name: str, module: Any) -> Callable[..., Any]:
    """The attention function ``name`` names, for ``module`` (``"eager"`` is each model
    file's own ``eager_attention_forward``, not in the shared table)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]  # type: ignore[no-any-return]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return eager if callable(eager) else sdpa_attention_forward


# -- what the adapter accepts --------------------------------------------------------
def check_model(model: Any) -> None:
    """Raise unless ``model`` is a causal LM whose attention ``PagedLM`` can drive.

    Args:
        model: The candidate model.

    Raises:
        TypeError: Not a transformers ``PreTrainedModel``.
        ValueError: Not a causal LM, in training mode, or an attention it cannot drive
            (the message says which).
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    config = model.config
    if config.is_encoder_decoder or not model.can_generate():
        raise ValueError(
            f"{name} is not a causal language model (an encoder-decoder, or no LM head): "
            "load it with AutoModelForCausalLM"
        )
    if model.training:
        raise ValueError(f"{name} is in training mode (dropout): call model.eval() first")
    reason = _unsupported_attention(model)
    if reason:
        raise ValueError(f"{name}: paged attention cannot drive {reason}")


def _unsupported_attention(model: Any) -> str | None:
    config = model.config
    if not getattr(model, "_supports_attention_backend", False):
        return "an attention outside transformers' attention interface"
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        return f"layers of type {', '.join(other)} (only full attention is supported)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "a sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "soft-capped attention logits"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention"
    return None


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder config.

    Args:
        config: A transformers ``PretrainedConfig`` (GPT-2's ``n_layer``/``n_head``
            are read through its attribute map).

    Raises:
        ValueError: The config does not say.
    """
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
    except AttributeError as exc:
        raise ValueError(f"cannot size a KV pool from {type(config).__name__}: {exc}") from None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return layers, int(kv_heads), int(head_dim)


def max_positions(config: Any) -> int | None:
    """The most tokens a model's position embeddings cover (``max_position_embeddings``,
    GPT-2's ``n_positions``), or None if its config does not say.

    Args:
        config: A transformers ``PretrainedConfig``.
    """
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
