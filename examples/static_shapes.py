"""Static shapes for a compiled model, declared once with `ShapeBuckets`.

A compiled model (``torch.compile``, CUDA graphs, TensorRT, an ONNX export) is
built for fixed shapes: every new (batch size, length) costs a recompilation. One
``ShapeBuckets`` grid given to ``@batched(shapes=...)`` makes every call one of its
cells: the policy batches requests by the grid length they pad to and pads the
batch up to a grid batch size, ``pad`` pads to the cell's length, and the dummy
rows and padding are cut off again before any caller sees a result.

With torch installed, the model is also ``torch.compile``d with a backend that
counts its compilations: one per cell, none once every cell was seen.
"""

from __future__ import annotations

import functools
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import batchkit

GRID = batchkit.ShapeBuckets(batch_sizes=(1, 2, 4, 8), lengths=(16, 32, 64))
rng = np.random.default_rng(0)
EMBED = rng.standard_normal((100, 24)).astype(np.float32)


def numpy_model(batch: batchkit.Padded) -> np.ndarray:
    """Mean-pooled embeddings [B, 24] of a padded batch of token ids."""
    assert batch.data.shape in GRID.cells  # every call is a cell of the grid
    states = EMBED[batch.data] * batch.mask[..., None]
    return states.sum(1) / np.maximum(batch.mask.sum(1, keepdims=True), 1)


def main() -> None:
    texts = [rng.integers(1, 100, size=int(n)) for n in rng.integers(1, 65, size=300)]
    # per_token=False: the [B, 24] output is pooled, whatever length the batch pads to
    embed = batchkit.batched(shapes=GRID, collate=batchkit.pad, per_token=False)(numpy_model)
    with ThreadPoolExecutor(32) as pool:
        vectors = list(pool.map(embed, texts))
    for text, got in zip(texts, vectors):
        np.testing.assert_allclose(got, EMBED[text].mean(0), rtol=1e-5, atol=1e-6)
    try:
        embed(np.ones(65, dtype=np.int64))  # longer than the grid's largest length
    except ValueError as exc:
        print(f"refused: {exc}")
    embed.close()
    print(f"{len(texts)} callers, every call a cell of {GRID!r}")
    if importlib.util.find_spec("torch") is not None:
        compile_once_per_cell(texts)


def compile_once_per_cell(texts: list[np.ndarray]) -> None:
    import torch

    compiles: list[tuple[int, ...]] = []

    def counting_backend(graph, example_inputs):  # counts, then runs the graph eagerly
        ids = next(x for x in example_inputs if not x.dtype.is_floating_point)
        compiles.append(tuple(ids.shape))
        return graph.forward

    # One graph per cell: let dynamo keep that many (its default is 8, then eager).
    torch._dynamo.config.recompile_limit = len(GRID.cells)
    module = torch.nn.Sequential(torch.nn.Embedding(100, 24), torch.nn.Linear(24, 8)).eval()
    compiled = torch.compile(module, backend=counting_backend, dynamic=False)
    collate = functools.partial(batchkit.pad, return_tensors="pt")

    @batchkit.batched(shapes=GRID, collate=collate, per_token=True)
    def encode(batch: batchkit.Padded) -> torch.Tensor:
        with torch.inference_mode():
            return compiled(batch.data)  # [B, L, 8], per token

    with ThreadPoolExecutor(32) as pool:
        for _ in range(3):  # the same traffic three times: compiled in the first pass only
            outputs = list(pool.map(encode, [torch.from_numpy(t) for t in texts]))
            print(f"after {len(texts)} more calls: {len(compiles)} compilations")
    encode.close()
    assert len(compiles) == len(set(compiles)) <= len(GRID.cells)
    assert all(out.shape == (len(t), 8) for out, t in zip(outputs, texts))


if __name__ == "__main__":
    main()
