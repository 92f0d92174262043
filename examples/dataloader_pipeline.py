"""A torch DataLoader pipeline: a batchkit policy as the batch_sampler, a batchkit
collator as the collate_fn.

A dataset of tokenised texts (stdlib docstrings, hashed words) is read by a
``DataLoader`` with ``num_workers=2``. Its ``batch_sampler`` (``policy.sampler``)
groups texts of similar length (``BucketedBatcher``), reshuffled every epoch from a
seed; its ``collate_fn`` (``PadCollator``) pads each batch and builds the attention
mask in the workers. The script checks that an epoch covers every example once, that
the same seed and epoch give the same batches and another epoch different ones, and
prints the padding waste against plain shuffled batches of the same size.

    python examples/dataloader_pipeline.py      # a few seconds on CPU
"""

from __future__ import annotations

import importlib
import inspect
import re
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import batchkit

VOCAB = 30_000
MODULES = ["collections", "functools", "itertools", "json", "os", "pathlib", "re", "threading"]


def docstrings() -> list[str]:
    """Public docstrings of a few stdlib modules (real text, lengths long-tailed)."""
    out: dict[str, None] = {}
    for name in MODULES:
        for attr, obj in sorted(vars(importlib.import_module(name)).items()):
            doc = None if attr.startswith("_") else inspect.getdoc(obj)
            if doc:
                out.setdefault(doc)
    return list(out)


class TextDataset(Dataset[dict[str, Any]]):
    """Tokenised texts as a tokenizer gives them: ``{"input_ids": [...], "label": int}``."""

    def __init__(self, texts: Sequence[str], max_length: int = 256) -> None:
        self.examples = [
            {"input_ids": self.tokenize(t)[:max_length], "label": i % 2}
            for i, t in enumerate(texts)
        ]

    @staticmethod
    def tokenize(text: str) -> list[int]:
        """Words and punctuation hashed to ids 1..VOCAB-1 (0 pads)."""
        words = re.findall(r"\w+|[^\w\s]", text.lower())
        return [1 + zlib.crc32(w.encode()) % (VOCAB - 1) for w in words]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]

    def lengths(self) -> list[int]:
        """Each example's token count: what the batch sampler groups by."""
        return [len(e["input_ids"]) for e in self.examples]


def padding_waste(loader: DataLoader[Any]) -> tuple[float, int]:
    """(share of padded positions that hold no token, number of batches) over one epoch."""
    real = total = batches = 0
    for batch in loader:
        mask = batch["attention_mask"]
        real, total, batches = real + int(mask.sum()), total + mask.numel(), batches + 1
    return 1 - real / total, batches


def main() -> None:
    dataset = TextDataset(docstrings())
    lengths = dataset.lengths()
    collate = batchkit.PadCollator(pad_to_multiple_of=8, return_tensors="pt")  # kernel-friendly

    # Batch dataset indices by their lengths; at most 32 per batch and 4096 padded
    # tokens, so a batch of long texts is smaller than one of short texts. Under DDP,
    # pass rank= and world_size= too: each process then gets its share of the batches.
    policy = batchkit.BucketedBatcher([16, 32, 64, 128, 256], max_batch_size=32, max_tokens=4096)
    sampler = policy.sampler(lengths, seed=0)
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=2, persistent_workers=True
    )

    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen: list[int] = []
        for batch in loader:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert ids.shape == mask.shape and ids.shape[1] % 8 == 0
            assert batch["labels"].shape == (ids.shape[0],)
            seen.extend(mask.sum(1).tolist())
        epochs.append(list(sampler))
        covered = sorted(i for b in epochs[-1] for i in b)
        assert covered == list(range(len(dataset))), "every example exactly once per epoch"
        assert sorted(seen) == sorted(lengths)

    sampler.set_epoch(0)
    assert list(sampler) == epochs[0], "same seed and epoch: same batches"
    assert epochs[0] != epochs[1], "another epoch: another order"

    bucketed, n_bucketed = padding_waste(loader)
    shuffled = DataLoader(
        dataset,
        batch_size=32,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        collate_fn=collate,
        num_workers=2,
    )
    plain, n_plain = padding_waste(shuffled)
    print(f"{len(dataset)} texts, {min(lengths)}-{max(lengths)} tokens")
    print(f"padding waste, shuffled batches of 32:   {plain:6.1%} ({n_plain} batches)")
    print(f"padding waste, BucketedBatcher sampler:  {bucketed:6.1%} ({n_bucketed} batches)")
    assert bucketed < plain


if __name__ == "__main__":  # needed for workers started with "spawn" (macOS, Windows)
    main()
