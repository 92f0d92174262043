"""Each caller gets its own result from a layout's batch-wide outputs.

A model behind ``@batched(collate=batchkit.pad)`` returns ``[B, L, H]`` token states
and ``[B, H]`` pooled vectors for the whole padded batch; batchkit cuts them back
with the layout's inverse (``Padded.split``), so every caller gets its own steps and
its own row, equal to what the model gives its item alone. The same with
``pack_varlen`` (a ``[T, H]`` output) and ``pack``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

import batchkit

HIDDEN = 64  # wider than any text: a [B, H] leaf is never mistaken for [B, L]
rng = np.random.default_rng(0)
EMBED = rng.standard_normal((100, HIDDEN))


def encode_padded(batch: batchkit.Padded) -> dict[str, np.ndarray]:
    states = np.tanh(EMBED[batch.data])  # [B, L, H], one token at a time
    mask = batch.mask[..., None]
    pooled = (states * mask).sum(1) / np.maximum(mask.sum(1), 1)  # [B, H], padding masked
    return {"states": states, "pooled": pooled}


def encode_varlen(batch: batchkit.Varlen) -> dict[str, np.ndarray]:
    states = np.tanh(EMBED[batch.values])  # [T, H]
    cu = batch.cu_seqlens.tolist()
    pooled = np.stack([states[s:e].mean(0) for s, e in zip(cu[:-1], cu[1:])])  # [N, H]
    return {"states": states, "pooled": pooled}


def main() -> None:
    texts = [rng.integers(1, 100, size=int(n)) for n in rng.integers(1, 40, size=200)]
    alone = [encode_padded(batchkit.pad([t])) for t in texts]  # one item per call

    for collate, model in ((batchkit.pad, encode_padded), (batchkit.pack_varlen, encode_varlen)):
        encode = batchkit.batched(max_batch_size=16, max_wait_ms=2, collate=collate)(model)
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(encode, texts))
        encode.close()
        for text, got, want in zip(texts, results, alone):
            assert got["states"].shape == (len(text), HIDDEN)  # its own steps, no padding
            np.testing.assert_allclose(got["states"], want["states"][0])
            np.testing.assert_allclose(got["pooled"], want["pooled"][0])
        print(f"{collate.__name__}: {len(texts)} callers, each equal to its item alone")

    # A model whose width a padded length can reach (here 64 tokens) declares which
    # leaves are per token; its list of per-item results is taken as it is.
    long_texts = [rng.integers(1, 100, size=int(n)) for n in (64, 3, 64, 10)]

    @batchkit.batched(max_batch_size=4, max_wait_ms=2, collate=batchkit.pad)
    def encode_declared(batch: batchkit.Padded) -> list[dict[str, np.ndarray]]:
        return batch.split(encode_padded(batch), per_token={"states"})

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(encode_declared, long_texts))
    encode_declared.close()
    assert [r["states"].shape[0] for r in results] == [64, 3, 64, 10]
    assert all(r["pooled"].shape == (HIDDEN,) for r in results)
    try:  # undeclared, the same output is refused, naming the leaf: never cut wrongly
        batchkit.pad(long_texts).split(encode_padded(batchkit.pad(long_texts)))
    except ValueError as exc:
        print("undeclared:", str(exc).split(":")[1].strip()[:60], "...")
    else:
        raise AssertionError("a [B, 64] leaf beside [B, 64, 64] states was not refused")


if __name__ == "__main__":
    main()
