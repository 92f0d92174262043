"""Sampling: the settings refuse bad values, each request draws from its own generator (so
its tokens are the same alone or batched, chunked or preempted), and the filters are
transformers' (same token for the same seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from batchkit.generate import (  # noqa: E402
    ContinuousBatcher,
    Sampling,
    StepBatch,
    TokenSampler,
    next_tokens,
)
from batchkit.kv import BlockAllocator  # noqa: E402
from tests.generate._toy import VOCAB, advance  # noqa: E402


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": -0.5}, ValueError, r"temperature must be a finite number >= 0, got -0.5"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": math.inf}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": math.nan}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, r"top_k must be >= 0 \(0 keeps every token\), got -1"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int"),
        ({"top_k": True}, TypeError, "top_k must be an int"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": "7"}, TypeError, "seed must be None or an int"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(
    kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        Sampling(**kwargs)


def test_submit_refuses_a_sampling_that_is_not_a_sampling() -> None:
    match = "sampling must be None or a batchkit.generate.Sampling"
    with (
        ContinuousBatcher(_stateless_step, max_num_seqs=2) as b,
        pytest.raises(TypeError, match=match),
    ):
        b.submit([1, 2], max_new_tokens=2, sampling={"temperature": 0.5})  # type: ignore[arg-type]


def _logits(history: list[int]) -> np.ndarray:
    """A toy model's next-token logits: a fixed function of every earlier token."""
    return np.random.default_rng(advance(0, history)).normal(0, 2, size=VOCAB)


seen: list[tuple[int, Sampling | None]] = []


def _stateless_step(batch: StepBatch) -> list[int | None]:
    """Recomputes each sequence from its tokens, so it is exact under any scheduling
    (chunks, preemption); samples with ``next_tokens`` where a sequence samples."""
    rows = [s for s in batch.seqs if s.sample]
    seen.extend((s.request_id, s.sampling) for s in rows)
    logits = torch.tensor(np.array([_logits(s.token_ids[: s.start + s.num_tokens]) for s in rows]))
    tokens = iter(next_tokens(logits.reshape(len(rows), VOCAB), [s.sampler for s in rows]))
    return [next(tokens) if s.sample else None for s in batch.seqs]


def test_the_step_function_sees_each_requests_sampling() -> None:
    seen.clear()
    s = Sampling(temperature=0.7, seed=3)
    with ContinuousBatcher(_stateless_step, max_num_seqs=2) as b:
        b.submit([1, 2], max_new_tokens=2, sampling=s).result(timeout=10)
        b.submit([3], max_new_tokens=1).result(timeout=10)
    assert seen == [(0, s), (0, s), (1, None)]


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),  # prompt
        st.integers(1, 8),  # max_new_tokens
        st.integers(0, 2**32),  # seed
        st.sampled_from([0.0, 0.5, 1.0, 1.7]),  # temperature (0: greedy)
        st.sampled_from([0, 1, 5]),  # top_k
        st.sampled_from([1.0, 0.9, 0.3]),  # top_p
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15)
@given(requests)
def test_seeded_requests_generate_the_same_alone_or_batched_chunked_and_preempted(
    reqs: list[tuple[list[int], int, int, float, int, float]],
) -> None:
    def run(batch_all: bool) -> list[list[int]]:
        # 6 blocks of 2 tokens and a budget of 4: chunked prefill, and preemption when
        # several long ones run together
        alloc = BlockAllocator(10, 2, prefix_caching=True)
        with ContinuousBatcher(
            _stateless_step, max_num_seqs=3 if batch_all else 1, max_num_batched_tokens=4,
            allocator=alloc,
        ) as b:  # fmt: skip
            out = []
            handles = []
            for prompt, n, seed, temp, k, p in reqs:
                sampling = Sampling(temperature=temp, top_k=k, top_p=p, seed=seed)
                h = b.submit(prompt, max_new_tokens=n, sampling=sampling)
                if batch_all:
                    handles.append(h)
                else:
                    out.append(h.result(timeout=30))
            return out + [h.result(timeout=30) for h in handles]

    assert run(batch_all=True) == run(batch_all=False)


def test_top_k_1_and_a_tiny_top_p_are_greedy() -> None:
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(size=(8, 50)))
    greedy = next_tokens(logits, [None] * 8)
    assert greedy == logits.argmax(-1).tolist()
    for sampling in (Sampling(top_k=1, seed=1), Sampling(top_p=1e-9, seed=1)):
        assert next_tokens(logits, [TokenSampler(sampling) for _ in range(8)]) == greedy


BROKEN_ROWS = {
    1: [float("nan"), 0.0, 1.0],  # a NaN among them
    2: [0.0, float("inf"), 1.0],  # +inf: the softmax is NaN
    3: [float("-inf")] * 3,  # every token masked
}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_rows_whose_logits_are_not_finite_get_an_error_and_the_others_their_tokens(
    sampled: bool,
) -> None:
    logits = torch.tensor([[0.0, 5.0, -1.0], *BROKEN_ROWS.values(), [2.0, -9.0, float("-inf")]])
    samplers = [TokenSampler(Sampling(top_k=1, seed=0)) if sampled else None for _ in range(5)]
    got = next_tokens(logits, samplers)
    assert got[0] == 1 and got[4] == 0  # (top_k=1: the draw is the argmax)
    for row in BROKEN_ROWS:
        assert isinstance(got[row], ValueError) and "not finite" in str(got[row])
    assert len({id(got[row]) for row in BROKEN_ROWS}) == 3  # an error of its own each


def test_a_temperature_that_overflows_the_logits_is_an_error_not_a_draw() -> None:
    sampler = TokenSampler(Sampling(temperature=1e-30, seed=0))
    logits = torch.tensor([[1e10, 0.0]])  # 1e40 after the temperature: +inf in float32
    (got,) = next_tokens(logits, [sampler])
    assert isinstance(got, ValueError)
    with pytest.raises(ValueError, match="not finite"):
        sampler.sample(logits[0])


def _nan_for_request_1(batch: StepBatch) -> list[int | ValueError | None]:
    rows = [s for s in batch.seqs if s.sample]
    logits = torch.tensor(np.array([_logits(s.token_ids[: s.start + s.num_tokens]) for s in rows]))
    for i, s in enumerate(rows):
        if s.request_id == 1:
            logits[i, 0] = float("nan")  # e.g. a bad adapter for this request
    tokens = iter(next_tokens(logits.reshape(len(rows), VOCAB), [s.sampler for s in rows]))
    return [next(tokens) if s.sample else None for s in batch.seqs]


@pytest.mark.parametrize("sampling", [None, Sampling(temperature=0.8, seed=4)], ids=repr)
def test_a_request_whose_logits_are_not_finite_fails_alone(sampling: Sampling | None) -> None:
    prompts = [[1, 2], [3, 4], [5, 6]]
    with ContinuousBatcher(_stateless_step, max_num_seqs=3) as b:
        want = [b.submit(p, max_new_tokens=3, sampling=sampling).result(10) for p in prompts]
    with ContinuousBatcher(_nan_for_request_1, max_num_seqs=3) as b:
        handles = [b.submit(p, max_new_tokens=3, sampling=sampling) for p in prompts]
        with pytest.raises(ValueError, match="next-token logits are not finite"):
            handles[1].result(timeout=10)
        assert [handles[0].result(timeout=10), handles[2].result(timeout=10)] == want[::2]
        assert b.stats().failed == 1


def test_next_tokens_needs_one_sampler_per_row() -> None:
    with pytest.raises(ValueError, match="2 samplers for 3 rows of logits"):
        next_tokens(torch.zeros(3, 5), [None, None])


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 3, 40, 100]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    logits_seed=st.integers(0, 1000),
)
def test_a_token_is_drawn_as_transformers_generate_draws_it(
    seed: int, temperature: float, top_k: int, top_p: float, logits_seed: int
) -> None:
    transformers = pytest.importorskip("transformers")
    logits = torch.tensor(np.random.default_rng(logits_seed).normal(0, 3, size=(1, 64)))
    # transformers' sampling: float32 logits, its warpers in its order, one multinomial
    # draw from the global generator
    scores = logits.to(torch.float32)
    warpers = []
    if temperature != 1.0:
        warpers.append(transformers.TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    for warper in warpers:
        scores = warper(None, scores)
    torch.manual_seed(seed)
    want = torch.multinomial(scores.softmax(-1), num_samples=1).item()
    sampler = TokenSampler(Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
    assert sampler.sample(logits[0]) == want


def test_an_unseeded_request_still_samples_from_one_generator_of_its_own() -> None:
    sampler = TokenSampler(Sampling(seed=None))
    logits = torch.zeros(1000)
    first = [sampler.sample(logits) for _ in range(5)]
    assert sampler.generator("cpu") is sampler.generator("cpu")
    assert len(set(first)) > 1  # uniform over 1000 tokens: five equal draws is ~1e-12
