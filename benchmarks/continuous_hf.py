"""Continuous batching of a Hugging Face causal LM: batchkit vs transformers' own, in one run.

Model: a tiny random Llama (float32, hidden 128, 4 layers, 4 heads of 32 with 2 KV
heads, vocab 1000, 1024 positions), built offline from a config; every system runs a
copy with the same weights. Workload: 64 prompts at once, lengths uniform in [16, 256],
``max_new_tokens`` long-tailed (lognormal, median 32, sigma 1.0, clipped to [4, 256]),
greedy, no eos (every request runs to its own length).

Systems (same limits: 32 sequences and 512 tokens per step, 16-token blocks, a pool
for 32 sequences at their longest):

- ``batchkit``: ``batchkit.integrations.transformers.continuous_batcher``;
- ``hf-manager``: transformers' continuous batching manager
  (``model.init_continuous_batching`` + ``add_request(ids, max_new_tokens=m)``);
- ``hf-generate-batch``: one ``model.generate_batch(prompts, generation_config)`` call;
  it takes one budget per call, so every request runs to the longest
  ``max_new_tokens`` and keeps its own (only those tokens are counted);
- ``static``: ``model.generate`` on left-padded batches of 16 in arrival order, each
  batch run to its longest ``max_new_tokens`` (each request keeps its own length).

Printed: output tokens/s of each, batchkit's ratio to each peer; batchkit's own bound
measured in the same run (tokens over the seconds spent inside the model's forward
passes, as if scheduling, layout and sampling were free) and the time per step spent
outside the model; and exactness: each system's tokens against the model's
``generate`` on each prompt alone, on a sample of prompts.

Target (PASS/MISS): batchkit >= 1.0x hf-manager tokens/s, and every sampled prompt
exact.

Usage::

    python benchmarks/continuous_hf.py                 # ~2 min on 2 cores
    python benchmarks/continuous_hf.py --quick         # 16 prompts, shorter outputs
    python benchmarks/continuous_hf.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import chosen_systems  # noqa: E402
from _report import check  # noqa: E402

from batchkit.integrations.transformers import continuous_batcher  # noqa: E402

SYSTEMS = ("batchkit", "hf-manager", "hf-generate-batch", "static")
MAX_NUM_SEQS = 32
BUDGET = 512
BLOCK = 16
STATIC_BATCH = 16


def make_model(device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()


def copy_of(model: Any) -> Any:
    """A model with the same weights and a config of its own (each system may change it)."""
    twin = type(model)(type(model.config).from_dict(model.config.to_dict()))
    twin.load_state_dict(model.state_dict())
    return twin.to(device=model.device, dtype=model.dtype).eval()


def workload(n: int, max_out: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    plens = rng.integers(16, 257, size=n)
    outs = np.clip(np.round(rng.lognormal(np.log(32), 1.0, size=n)), 4, max_out).astype(int)
    return [rng.integers(1, 1000, size=int(k)).tolist() for k in plens], outs.tolist()


class TimedModel:
    """The model, with the seconds its forward passes take added up."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.model(**kwargs)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def run_batchkit(model: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    longest = max(len(p) + n for p, n in zip(prompts, outs))
    cb = continuous_batcher(
        model, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET, block_size=BLOCK,
        num_blocks=MAX_NUM_SEQS * -(-longest // BLOCK), prefix_caching=False,
    )  # fmt: skip
    timed = TimedModel(model)
    cb.step_fn.model = timed  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    handles = [cb.submit(p, max_new_tokens=n) for p, n in zip(prompts, outs)]
    got = [h.result() for h in handles]
    seconds = time.perf_counter() - t0
    cb.close()
    steps = cb.stats().steps
    return {
        "seconds": seconds,
        "tokens": got,
        "model_seconds": timed.seconds,
        "outside_per_step": (seconds - timed.seconds) / max(steps, 1),
        "steps": steps,
    }


def _hf_configs(model: Any, prompts: list[list[int]], outs: list[int]) -> tuple[Any, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(p) + n for p, n in zip(prompts, outs))
    gen = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(outs)
    )
    cb = ContinuousBatchingConfig(
        page_size=BLOCK, num_blocks=MAX_NUM_SEQS * -(-longest // BLOCK),
        max_batch_tokens=BUDGET, max_requests_per_batch=MAX_NUM_SEQS,
    )  # fmt: skip
    return gen, cb


def run_hf_manager(model: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    gen, cbc = _hf_configs(model, prompts, outs)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    try:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, outs)]
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers' manager stopped before every request finished")
            if r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return {"seconds": seconds, "tokens": [results[i] for i in ids]}


def run_hf_generate_batch(model: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    # one call takes one budget: every request runs to the longest, each keeps its own
    gen, cbc = _hf_configs(model, prompts, outs)
    t0 = time.perf_counter()
    res = model.generate_batch(
        prompts, generation_config=gen, continuous_batching_config=cbc, progress_bar=False
    )
    seconds = time.perf_counter() - t0
    got = [list(out.generated_tokens)[:n] for out, n in zip(res.values(), outs)]
    return {"seconds": seconds, "tokens": got}


def run_static(model: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    got: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), STATIC_BATCH):
        group, lengths = prompts[i : i + STATIC_BATCH], outs[i : i + STATIC_BATCH]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device
        )
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        got.extend(row[width : width + n] for row, n in zip(out.tolist(), lengths))
    return {"seconds": time.perf_counter() - t0, "tokens": got}


def solo(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


RUNS: dict[str, Callable[[Any, list[list[int]], list[int]], dict[str, Any]]] = {
    "batchkit": run_batchkit,
    "hf-manager": run_hf_manager,
    "hf-generate-batch": run_hf_generate_batch,
    "static": run_static,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 prompts, outputs clipped to 64")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--prompts", type=int, default=None, help="number of prompts (default 64)")
    p.add_argument("--sample", type=int, default=8, help="prompts checked against solo greedy")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = chosen_systems(p, args.systems, SYSTEMS)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # its manager logs psutil's absence on every start: noise for this comparison
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    n = args.prompts or (16 if args.quick else 64)
    prompts, outs = workload(n, 64 if args.quick else 256)
    base = make_model(args.device)
    total = sum(outs)
    print(
        f"{n} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{total} output tokens (max_new_tokens {min(outs)}-{max(outs)}, median "
        f"{int(np.median(outs))}), device {args.device}, torch threads {torch.get_num_threads()}"
    )
    # warm-up: one short request through each system's code paths
    for name in systems:
        RUNS[name](copy_of(base), prompts[:2], [2, 3])
    results = {name: RUNS[name](copy_of(base), prompts, outs) for name in systems}

    sample = np.random.default_rng(1).choice(n, size=min(args.sample, n), replace=False).tolist()
    want = {i: solo(base, prompts[i], outs[i]) for i in sample}
    print(f"\n{'system':<20}{'tokens/s':>10}{'seconds':>10}{'exact':>10}")
    for name, r in results.items():
        exact = sum(r["tokens"][i] == want[i] for i in sample)
        r["exact"] = exact
        print(
            f"{name:<20}{total / r['seconds']:>10.0f}{r['seconds']:>10.2f}{exact:>7}/{len(sample)}"
        )
    ok = True
    if "batchkit" in results:
        bk = results["batchkit"]
        rate = total / bk["seconds"]
        bound = total / bk["model_seconds"]
        print(
            f"\nbatchkit: {bk['steps']} steps; bound (model forward only) {bound:.0f} tokens/s, "
            f"batchkit at {rate / bound:.2f}x of it; outside the model "
            f"{bk['outside_per_step'] * 1e3:.2f} ms per step "
            f"(inside {bk['model_seconds'] / bk['steps'] * 1e3:.2f} ms)"
        )
        for name, r in results.items():
            if name != "batchkit":
                print(f"batchkit / {name}: {rate / (total / r['seconds']):.2f}x")
        if "hf-manager" in results:
            ratio = rate / (total / results["hf-manager"]["seconds"])
            ok &= check(
                "batchkit >= 1.0x transformers' manager tokens/s", ratio >= 1.0, f"{ratio:.2f}x"
            )
        ok &= check(
            "batchkit exact on every sampled prompt", bk["exact"] == len(sample),
            f"{bk['exact']}/{len(sample)}",
        )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
