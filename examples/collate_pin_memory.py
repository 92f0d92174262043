"""Pinned batches and ``to_device``: the copy to the GPU overlaps with the GPU's work.

With CUDA, ``pin_memory=True`` allocates every tensor of a batch in page-locked host
memory, and ``batchkit.to_device`` copies a pinned tensor with ``non_blocking=True``:
the host queues the copy and goes on (to collate the next batch) while the GPU runs.
Without CUDA, ``pin_memory=True`` is refused with a clear error, and ``to_device``
moves batches to "cpu" (or "meta"), so this script runs anywhere.

Run: python examples/collate_pin_memory.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import batchkit

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

gen = torch.Generator().manual_seed(0)
requests = [torch.randint(1, 1000, (n,), generator=gen) for n in (12, 3, 7, 30)]

# A layout, pinned where CUDA exists.
if CUDA:
    batch = batchkit.pad(requests, pad_to_multiple_of=8, pin_memory=True)
    assert batch.data.is_pinned() and batch.mask.is_pinned() and batch.lengths.is_pinned()
else:
    try:
        batchkit.pad(requests, pin_memory=True)
    except RuntimeError as exc:
        print("without CUDA:", exc)
    else:
        raise AssertionError("pin_memory=True should be refused without CUDA")
    batch = batchkit.pad(requests, pad_to_multiple_of=8)

on_device = batchkit.to_device(batch, DEVICE)  # a Padded again, every tensor moved
assert isinstance(on_device, batchkit.Padded) and on_device.data.device.type == DEVICE
for mine, original in zip(on_device.unpad(on_device.data), requests, strict=True):
    assert torch.equal(mine.cpu(), original)
print(f"pad -> to_device({DEVICE!r}): data {tuple(on_device.data.shape)}")

# In a DataLoader, the collator pins in this process (num_workers=0)...
dataset = [{"input_ids": r.tolist(), "label": i % 2} for i, r in enumerate(requests)]
embed = torch.nn.Embedding(1000, 16).to(DEVICE)
collate = batchkit.PadCollator(pad_to_multiple_of=8, return_tensors="pt", pin_memory=CUDA)
for features in DataLoader(dataset, batch_size=2, collate_fn=collate):
    features = batchkit.to_device(features, DEVICE)  # a dict of tensors, non-blocking if pinned
    ids, mask = features["input_ids"], features["attention_mask"]
    with torch.no_grad():
        pooled = (embed(ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    assert pooled.shape == (2, 16) and pooled.device.type == DEVICE

# ...while with worker processes the DataLoader pins (a worker's batch reaches this
# process through shared memory, which is not page-locked; the collator refuses there).
loader = DataLoader(
    dataset,
    batch_size=2,
    num_workers=1,
    collate_fn=batchkit.PadCollator(return_tensors="pt"),
    pin_memory=CUDA,
)
for features in loader:
    features = batchkit.to_device(features, DEVICE)
    assert features["input_ids"].device.type == DEVICE
print("ok")
