"""examples/embed_minilm.py times fairly: the ways take turns, and the padding it reports
is the share of computed tokens that are padding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import batchkit  # noqa: E402
from tests._modules import load_module  # noqa: E402

example = load_module(Path(__file__).resolve().parents[2] / "examples" / "embed_minilm.py",
                      "embed_minilm_example")  # fmt: skip


def test_the_ways_are_timed_in_turn_round_after_round() -> None:
    calls: list[str] = []
    ways = {name: (lambda name=name: calls.append(name)) for name in ("alone", "sorted", "online")}
    seconds = example.timed(ways, rounds=3)
    assert calls == ["alone", "sorted", "online"] * 3  # not alone x3, then sorted x3, ...
    assert {name: len(runs) for name, runs in seconds.items()} == dict.fromkeys(ways, 3)


class _Tokens:
    """A stand-in for the model's tokenizer: a text of n words is n tokens."""

    def tokenize(self, texts: list[str]) -> list[dict[str, Any]]:
        return [{"input_ids": [1] * len(t.split())} for t in texts]


def test_the_padding_share_counts_what_the_batches_pad() -> None:
    texts = ["a"] * 3 + ["a " * 9]  # lengths 1, 1, 1, 9
    one_batch = batchkit.SortedBatcher(key=example.token_count, batch_size=4)
    # One batch of 4 padded to 9: 36 computed, 12 real.
    assert example.padding_share(_Tokens(), texts, one_batch) == pytest.approx(1 - 12 / 36)
    pairs = batchkit.SortedBatcher(key=example.token_count, batch_size=2)
    # Sorted pairs (1, 1) and (1, 9): 2 + 18 computed, 12 real.
    assert example.padding_share(_Tokens(), texts, pairs) == pytest.approx(1 - 12 / 20)
