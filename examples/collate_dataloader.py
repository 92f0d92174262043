"""PadCollator (and VarlenCollator) as a torch DataLoader's collate_fn.

A small in-memory dataset of tokenised examples (dicts with ``input_ids`` lists and
an int ``label``) goes through a DataLoader; every batch comes out padded, with an
``attention_mask``, ready for a model. A masked mean-pool over the padded batch is
checked against pooling each example alone.

Run: python examples/collate_dataloader.py
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import DataLoader, Dataset

import batchkit

PAD_ID = 0


class TokenDataset(Dataset):
    """Examples as a tokenizer would give them: {"input_ids": [...], "label": int}."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.examples = [
            {
                "input_ids": [rng.randrange(1, 1000) for _ in range(rng.randint(3, 40))],
                "label": rng.randrange(2),
            }
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


dataset = TokenDataset(100)
embed = torch.nn.Embedding(1000, 8)

# Pad to the longest in each batch, rounded up to a multiple of 8 (tensor-core
# friendly shapes, fewer distinct shapes for compiled models). "label" is stacked and
# renamed "labels", as transformers' collators do. The features hold python lists,
# which give numpy unless return_tensors asks for torch.
collate = batchkit.PadCollator(
    pad_values={"input_ids": PAD_ID}, pad_to_multiple_of=8, return_tensors="pt"
)
loader = DataLoader(dataset, batch_size=16, shuffle=True, collate_fn=collate)

seen = 0
for batch in loader:
    ids, mask = batch["input_ids"], batch["attention_mask"]  # int64 [B, L], L % 8 == 0
    assert ids.shape == mask.shape and ids.shape[1] % 8 == 0
    assert batch["labels"].shape == (ids.shape[0],)
    with torch.no_grad():
        h = embed(ids)  # [B, L, 8]
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # padding ignored
    # Same as pooling each example alone (recover them from the mask).
    for row, m, p in zip(ids, mask, pooled, strict=True):
        alone = embed(row[m.bool()]).mean(0)
        assert torch.allclose(p, alone, atol=1e-6)
    seen += ids.shape[0]
assert seen == len(dataset)
print(f"PadCollator: {seen} examples in {len(loader)} padded batches")

# The padding-free alternative for varlen (FlashAttention) kernels: one [1, T] row
# per batch plus cu_seq_lens; sample_index says which example each segment is.
varlen_loader = DataLoader(
    dataset,
    batch_size=16,
    shuffle=True,
    collate_fn=batchkit.VarlenCollator(return_tensors="pt", return_sample_index=True),
)
batch = next(iter(varlen_loader))
cu = batch["cu_seq_lens_q"]
assert batch["input_ids"].shape == (1, int(cu[-1]))
assert "attention_mask" not in batch  # the boundaries live in cu_seq_lens / position_ids
print(
    f"VarlenCollator: one row of {int(cu[-1])} tokens, {len(cu) - 1} sequences, "
    f"max_length_q={batch['max_length_q']}"
)
# sample_index is the example's position in the batch here (the DataLoader hands
# the collator a list); sequence j is batch["input_ids"][0, cu[j]:cu[j+1]].
print("ok")
