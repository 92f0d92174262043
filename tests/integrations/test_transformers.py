"""Hugging Face causal LMs through ``continuous_batcher``: tiny random Llama, Qwen2 and GPT-2
(float64, built offline from configs) generate exactly what ``model.generate`` generates
for each prompt alone, greedy or seeded, under chunking, preemption, prefix sharing and
concurrent callers; bad models and bad requests are refused with a clear error."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit.generate import ContinuousBatcher, Sampling  # noqa: E402
from batchkit.integrations.transformers import (  # noqa: E402
    DEFAULT_KV_BYTES,
    PagedLM,
    continuous_batcher,
    default_num_blocks,
)
from batchkit.kv import kv_block_bytes  # noqa: E402

VOCAB = 101
POSITIONS = 64


def tiny(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random causal LM of ``family``, float64, in eval mode."""
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=4, **common, **overrides
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config_class, model_class = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[family]
        config = config_class(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=POSITIONS, **common, **overrides,
        )  # fmt: skip
        model = model_class(config)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def model(request: pytest.FixtureRequest) -> Any:
    return tiny(request.param)


def generate(model: Any, prompt: list[int], n: int, **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("eos_token_id", None)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt) :].tolist()


def prompts(seed: int, count: int, common: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        (common if common and i % 2 == 0 else [])
        + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        for i in range(count)
    ]


def test_greedy_equals_generate_on_each_prompt_alone_with_chunked_prefill(model: Any) -> None:
    ps = prompts(1, 8)
    lengths = [1 + i % 9 for i in range(len(ps))]
    want = [generate(model, p, n) for p, n in zip(ps, lengths)]
    # a budget of 24 tokens and chunks of at most 8: prefills split and share steps
    with continuous_batcher(
        model, max_num_seqs=4, max_num_batched_tokens=24, max_prefill_chunk=8, num_blocks=64,
        block_size=4,
    ) as cb:  # fmt: skip
        got = [
            h.result(timeout=60)
            for h in [cb.submit(p, max_new_tokens=n) for p, n in zip(ps, lengths)]
        ]
    assert got == want
    # the adapter's attention serves only its own steps: generate() is unchanged after it
    assert [generate(model, p, n) for p, n in zip(ps, lengths)] == want


def test_steps_padded_to_fixed_sizes_generate_what_each_prompt_does_alone(model: Any) -> None:
    ps = prompts(5, 7)
    lengths = [1 + i % 6 for i in range(len(ps))]
    want = [generate(model, p, n) for p, n in zip(ps, lengths)]
    # every step runs 4 rows: padding rows are computed but write no key or value
    with continuous_batcher(
        model, max_num_seqs=4, num_blocks=64, block_size=4, step_sizes=(4,)
    ) as cb:
        got = [
            h.result(timeout=60)
            for h in [cb.submit(p, max_new_tokens=n) for p, n in zip(ps, lengths)]
        ]
        padded = cb.stats().padding_rows
    assert got == want
    assert padded > 0


def test_a_pool_too_small_for_all_preempts_and_recomputes_without_changing_outputs(
    model: Any,
) -> None:
    ps = prompts(2, 6)
    want = [generate(model, p, 12) for p in ps]
    step = PagedLM(model, num_blocks=12, block_size=4, prefix_caching=False)
    with ContinuousBatcher(
        step, allocator=step.allocator, max_num_seqs=4, max_num_batched_tokens=32
    ) as cb:
        got = [h.result(timeout=60) for h in [cb.submit(p, max_new_tokens=12) for p in ps]]
        stats = cb.stats()
    assert stats.preemptions > 0
    assert got == want
    assert step.allocator.num_free == step.allocator.num_blocks


def test_shared_prefixes_hit_the_cache_and_outputs_are_unchanged(model: Any) -> None:
    system = [7, 3, 9, 12, 44, 5, 61, 18, 2, 90, 33, 4]  # three full blocks of 4
    ps = prompts(3, 6, common=system)
    want = [generate(model, p, 6) for p in ps]
    with continuous_batcher(
        model, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=48, block_size=4
    ) as cb:
        got = [h.result(timeout=60) for h in [cb.submit(p, max_new_tokens=6) for p in ps]]
        stats = cb.stats()
    assert stats.prefix_hit_rate > 0
    assert got == want


def test_seeded_sampling_is_the_same_alone_or_batched_and_as_generate_draws_it(
    model: Any,
) -> None:
    ps = prompts(4, 5)
    settings = [
        Sampling(temperature=0.8, top_k=20, top_p=0.95, seed=7),
        Sampling(temperature=1.3, seed=11),
        Sampling(top_p=0.5, seed=12),
        Sampling(temperature=0.0),  # greedy
        Sampling(top_k=3, seed=2**40),
    ]

    def run(max_num_seqs: int) -> list[list[int]]:
        with continuous_batcher(
            model, max_num_seqs=max_num_seqs, max_num_batched_tokens=16, num_blocks=40,
            block_size=4,
        ) as cb:  # fmt: skip
            hs = [cb.submit(p, max_new_tokens=8, sampling=s) for p, s in zip(ps, settings)]
            return [h.result(timeout=60) for h in hs]

    alone, batched = run(1), run(5)
    assert alone == batched
    # one request alone draws what generate() draws from a generator seeded alike
    s = settings[0]
    torch.manual_seed(s.seed)
    want = generate(
        model, ps[0], 8, do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
    )
    assert alone[0] == want
    assert alone[3] == generate(model, ps[3], 8)


def test_sixteen_concurrent_submitters_each_get_their_own_greedy_tokens() -> None:
    model = tiny("llama", seed=5)
    ps = prompts(5, 16)
    want = [generate(model, p, 5) for p in ps]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with continuous_batcher(
        model, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=96, block_size=4
    ) as cb:
        start = threading.Barrier(16)

        def caller(i: int) -> None:
            try:
                start.wait()
                got[i] = cb.submit(ps[i], max_new_tokens=5).result(timeout=60)
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert [got[i] for i in range(16)] == want


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_request_with_nan_keys_fails_alone_and_poisons_no_later_request(sampled: bool) -> None:
    clean = tiny("llama", seed=1)
    model = tiny("llama", seed=1)
    with torch.no_grad():
        model.get_input_embeddings().weight[100] = float("nan")  # a bad embedding row
    sampling = Sampling(temperature=0.9, seed=7) if sampled else None
    short, long = [5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]
    with continuous_batcher(
        clean, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32, block_size=4
    ) as cb:
        want = [cb.submit(p, max_new_tokens=4, sampling=sampling).result(60) for p in (short, long)]
    with continuous_batcher(
        model, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32, block_size=4
    ) as cb:
        poisoned = cb.submit([100] * 5, max_new_tokens=4, sampling=sampling)  # takes block 0
        beside = cb.submit(short, max_new_tokens=4, sampling=sampling)  # in its steps
        with pytest.raises(ValueError, match="next-token logits are not finite"):
            poisoned.result(timeout=60)
        assert beside.result(timeout=60) == want[0]
        # later, the short one's keys are padded to the long one's in a decode group
        handles = [cb.submit(p, max_new_tokens=4, sampling=sampling) for p in (short, long)]
        assert [h.result(timeout=60) for h in handles] == want


def test_eos_from_the_generation_config_stops_early_unless_overridden() -> None:
    model = tiny("llama", seed=6)
    prompt = [5, 9, 13, 2]
    free = generate(model, prompt, 10)
    eos = free[3]
    first = free.index(eos)
    model.generation_config.eos_token_id = [VOCAB - 1, eos]  # a list, as many models ship
    with continuous_batcher(model, num_blocks=16, block_size=4) as cb:
        h = cb.submit(prompt, max_new_tokens=10)
        assert h.result(timeout=60) == free[: first + 1]
        assert h.finish_reason == "stop"
    with continuous_batcher(model, num_blocks=16, block_size=4, eos_token_id=None) as cb:
        assert cb.submit(prompt, max_new_tokens=10).result(timeout=60) == free


def test_two_adapters_over_two_models_in_one_process_do_not_see_each_other() -> None:
    a, b = tiny("llama", seed=7), tiny("gpt2", seed=8)
    ps = prompts(6, 4)
    want_a = [generate(a, p, 6) for p in ps]
    want_b = [generate(b, p, 6) for p in ps]
    with (
        continuous_batcher(a, num_blocks=32, block_size=4) as cb_a,
        continuous_batcher(b, num_blocks=32, block_size=4) as cb_b,
    ):
        ha = [cb_a.submit(p, max_new_tokens=6) for p in ps]
        hb = [cb_b.submit(p, max_new_tokens=6) for p in ps]
        assert [h.result(timeout=60) for h in ha] == want_a
        assert [h.result(timeout=60) for h in hb] == want_b
    assert a.config._attn_implementation != b.config._attn_implementation


def test_the_default_pool_holds_max_num_seqs_sequences_at_full_length_within_a_budget() -> None:
    model = tiny("llama")
    with continuous_batcher(model, max_num_seqs=3, block_size=8) as cb:
        assert cb.allocator is not None
        assert cb.allocator.num_blocks == 3 * POSITIONS // 8
        assert cb.submit([1, 2, 3], max_new_tokens=2).result(timeout=60) == generate(
            model, [1, 2, 3], 2
        )
    # cut to DEFAULT_KV_BYTES, but never below one sequence at full length
    per_block = kv_block_bytes(8, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float64)
    many = default_num_blocks(model, max_num_seqs=10**6, block_size=8)
    assert many == DEFAULT_KV_BYTES // per_block
    assert default_num_blocks(model, max_num_seqs=1, block_size=8, max_model_len=20) == 3


# -- refusals ------------------------------------------------------------------------
def test_a_model_that_is_not_a_causal_lm_is_refused() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="LlamaModel is not a causal language model"):
        continuous_batcher(transformers.LlamaModel(config).eval())
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel, got Linear"):
        PagedLM(torch.nn.Linear(2, 2), num_blocks=4)


def test_a_model_in_training_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"training mode .*model.eval\(\)"):
        continuous_batcher(tiny("llama").train())


def test_an_attention_it_cannot_drive_is_refused() -> None:
    sliding = tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="cannot drive layers of type sliding_attention"):
        continuous_batcher(sliding, num_blocks=8)

    class OwnAttention(transformers.LlamaForCausalLM):
        _supports_attention_backend = False

    torch.manual_seed(0)
    own = OwnAttention(tiny("llama").config).eval()
    with pytest.raises(ValueError, match="an attention outside transformers' attention interface"):
        PagedLM(own, num_blocks=8)
    with pytest.raises(ValueError, match="cannot drive cross-attention"):
        PagedLM(tiny("gpt2", add_cross_attention=True), num_blocks=8)


def test_bad_requests_are_refused_at_submit() -> None:
    model = tiny("llama")
    with continuous_batcher(model, num_blocks=16, block_size=4) as cb:
        with pytest.raises(
            ValueError, match=f"leaves no room to generate within max_model_len={POSITIONS}"
        ):
            cb.submit(list(range(1, POSITIONS + 1)), max_new_tokens=1)
        for bad, match in [
            ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
            ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
            ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
            ({"top_k": -2}, "top_k must be >= 0"),
        ]:
            with pytest.raises(ValueError, match=match):
                cb.submit([1, 2], max_new_tokens=2, sampling=Sampling(**bad))
        assert cb.submit([1, 2], max_new_tokens=2).result(timeout=60) == generate(model, [1, 2], 2)
    with pytest.raises(
        ValueError, match=f"max_model_len=100 exceeds the model's {POSITIONS} positions"
    ):
        continuous_batcher(model, max_model_len=100)


def test_generate_on_the_same_model_from_another_thread_during_steps_keeps_its_own_attention() -> (
    None
):
    model = tiny("llama", seed=9)
    # a padded batch: right only if generate() still gets its mask and its own attention
    batch = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def padded() -> list[list[int]]:
        out = model.generate(
            batch, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
        return out[:, 5:].tolist()

    want_padded = padded()
    ps = prompts(7, 8)
    want = [generate(model, p, 30) for p in ps]
    with continuous_batcher(model, max_num_seqs=2, num_blocks=64, block_size=4) as cb:
        # about 120 steps on the batcher's thread; the generate() calls run meanwhile
        handles = [cb.submit(p, max_new_tokens=30) for p in ps]
        during = [padded() for _ in range(3)]
        got = [h.result(timeout=60) for h in handles]
    assert during == [want_padded] * 3
    assert got == want
