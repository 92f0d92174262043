"""Collate benchmark: batchkit's pad / varlen collators against their peers, same run.

Workload: a batch of 64 token sequences with long-tailed lengths (lognormal, median
128, clipped to [8, 1024]) and int token ids, given either as python lists of ints
or as torch int64 tensors. Every system is first checked to produce the same batch
as batchkit, then all are timed interleaved (see ``_timing.py``) and the script
prints per-system medians, speedups and PASS/MISS lines for the targets:

- pad from lists: batchkit >= 10x faster than ``transformers.DataCollatorWithPadding``;
- varlen from lists: batchkit >= 3x faster than ``transformers.DataCollatorWithFlattening``;
- pad from tensors: ``batchkit.pad`` no slower than ``pad_sequence`` + mask (>= 1.0x,
  with a 5% noise band).
- with ``--baseline PATH`` (a checkout of an earlier batchkit, e.g. ``git worktree add
  /tmp/bk-base <commit>``): each numpy and torch case at least 0.95x as fast as that
  checkout's code, both timed interleaved in this one process;
- with JAX installed: ``batchkit.pad`` on JAX arrays against a hand-written ``jnp``
  padding loop (``jnp.pad`` per item, ``jnp.stack``, a mask from the lengths), and
  ``pack_varlen`` against ``jnp.concatenate``; informational, no target.

Usage::

    python benchmarks/collate.py            # ~30-60 s
    python benchmarks/collate.py --quick    # ~10 s, noisier
    python benchmarks/collate.py --baseline /tmp/bk-base  # also: this code vs that one
    python benchmarks/collate.py --prototype  # also time the prototype fast pad
    python benchmarks/collate.py --breakdown  # batchkit.pad on tensors, stage by stage

Torch runs single-threaded by default (``--threads``), as it does inside
``DataLoader`` workers, where collation normally happens; the machine's other
load then disturbs every system alike.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Timing, measure, print_table, report_target, speedup  # noqa: E402

import batchkit  # noqa: E402
from batchkit.collate.pad import real_token_mask  # noqa: E402

NOISE_BAND = 0.05  # "no slower" allows the ratio to dip this far below 1.0


# --------------------------------------------------------------------------- workload


def make_workload(batch: int, seed: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``batch`` sequences, lengths lognormal(median 128, sigma 1) clipped to [8, 1024]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(128), 1.0, size=batch).astype(np.int64), 8, 1024)
    lists = [rng.integers(2, 32_000, size=int(n)).tolist() for n in lengths]
    tensors = [torch.tensor(s, dtype=torch.int64) for s in lists]
    return lists, tensors


def hf_collators() -> tuple[Any, Any]:
    """HF's padding and flattening collators, with a tokenizer built offline."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import (
        DataCollatorWithFlattening,
        DataCollatorWithPadding,
        PreTrainedTokenizerFast,
    )
    from transformers.utils import logging

    logging.set_verbosity_error()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(8)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]"
    )
    padding = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    flattening = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    return padding, flattening


# --------------------------------------------------------------------------- peers


def pad_sequence_with_mask(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The usual torch idiom: ``pad_sequence`` + a bool mask built from the lengths."""
    lengths = torch.tensor([s.shape[0] for s in seqs])
    data = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=0)
    mask = torch.arange(data.shape[1]) < lengths[:, None]
    return data, mask


def pad_sequence_from_lists(seqs: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same idiom when the items are python lists: one ``torch.tensor`` per item first."""
    return pad_sequence_with_mask([torch.tensor(s) for s in seqs])


def _data_mask(batch: batchkit.Padded) -> tuple[Any, Any]:
    return batch.data, batch.mask


def batchkit_pad(seqs: Sequence[Any]) -> tuple[Any, Any]:
    return _data_mask(batchkit.pad(seqs, return_tensors="pt"))


def cat_floor(seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One copy of every token: a lower bound for any layout built from tensors."""
    return torch.cat(list(seqs))


def list_floor(seqs: Sequence[list[int]]) -> torch.Tensor:
    """One conversion of every token from python ints: the floor for list inputs."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64))


# --------------------------------------------------------------------------- prototype


def prototype_pad_tensors(
    seqs: Sequence[torch.Tensor], *, pad_value: Any = 0, side: str = "right"
) -> batchkit.Padded:
    """Prototype of a faster ``batchkit.pad`` for tensor items (not in batchkit yet).

    Same result (a :class:`batchkit.Padded`) and the same checks as batchkit's path
    (tensors only, one device, a sequence axis, equal feature axes), with the three
    changes the profile of ``batchkit.pad`` on tensors points to:

    1. one cheap validation pass instead of ``kind_of``/``_item_array`` per item
       plus separate feature-shape, length and device loops;
    2. ``torch.cat`` under ``no_grad`` instead of one ``detach()`` per item;
    3. the scatter into the padded block done through zero-copy numpy views on CPU
       (numpy boolean assignment is ~6x faster than torch's ``data[mask] = values``,
       which goes through ``nonzero`` + ``index_put_``); elsewhere, or for dtypes
       numpy lacks (bfloat16), ``masked_scatter_``, which also avoids the host sync
       that boolean indexing costs on CUDA.
    """
    first = seqs[0]
    device, feat = first.device, first.shape[1:]
    tensor_type = torch.Tensor
    for i, s in enumerate(seqs):
        if not isinstance(s, tensor_type):
            raise TypeError(f"item {i}: expected a tensor, got {type(s).__name__}")
        if s.ndim == 0 or s.shape[1:] != feat or s.device != device:
            raise ValueError(f"item {i}: shape {tuple(s.shape)} / device {s.device} mismatch")
    lengths = np.fromiter((s.shape[0] for s in seqs), dtype=np.int64, count=len(seqs))
    with torch.no_grad():
        values = torch.cat(list(seqs))
    width = int(lengths.max(initial=0))
    host_mask = real_token_mask(lengths, width, side)
    data = torch.full((len(seqs), width, *feat), pad_value, dtype=values.dtype, device=device)
    mask = torch.from_numpy(host_mask).to(device)
    if device.type == "cpu" and values.dtype != torch.bfloat16:
        data.numpy()[host_mask] = values.numpy()
    else:
        data.masked_scatter_(mask.view(*mask.shape, *([1] * len(feat))), values)
    return batchkit.Padded(
        data=data,
        mask=mask,
        lengths=torch.from_numpy(lengths).to(device),
        side=side,  # type: ignore[arg-type]
        _host_lengths=tuple(lengths.tolist()),
    )


def breakdown_pad_tensors(tensors: list[torch.Tensor], repeats: int, min_time: float) -> None:
    """Stage-by-stage timing of ``batchkit.pad(tensors, return_tensors="pt")``.

    Replays the stages of ``to_ragged`` and ``pad_ragged`` (batchkit/collate/ragged.py,
    batchkit/collate/pad.py) on the same inputs, next to the prototype's
    replacement for each, all interleaved.
    """
    from batchkit._backend import kind_of
    from batchkit.collate.pad import pad_ragged
    from batchkit.collate.ragged import _item_array, to_ragged

    ragged = to_ragged(tensors, return_tensors="pt")
    lengths = ragged.lengths
    width = int(lengths.max())
    host_mask = real_token_mask(lengths, width, "right")
    mask = torch.from_numpy(host_mask)
    values = ragged.values
    data = torch.zeros((len(tensors), width), dtype=values.dtype)

    def per_item_checks() -> None:  # to_ragged: kind_of + _item_array + shape/device loops
        for i, a in enumerate(tensors):
            kind_of(a)
            _item_array(a, i, "pt")
        for a in tensors:
            tuple(a.shape[1:])
            a.device  # noqa: B018

    def one_pass_checks() -> None:
        feat, device = tensors[0].shape[1:], tensors[0].device
        for s in tensors:
            if (
                not isinstance(s, torch.Tensor)
                or s.ndim == 0
                or s.shape[1:] != feat
                or s.device != device
            ):
                raise ValueError

    def cat_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat(tensors)

    def numpy_view_assign() -> None:
        data.numpy()[host_mask] = values.numpy()

    cases = {
        "batchkit.pad (total)": lambda: batchkit.pad(tensors, return_tensors="pt"),
        "  to_ragged (total)": lambda: to_ragged(tensors, return_tensors="pt"),
        "    per-item checks": per_item_checks,
        "    torch.cat([a.detach() ...])": lambda: torch.cat([a.detach() for a in tensors]),
        "  pad_ragged (total)": lambda: pad_ragged(ragged),
        "    torch.full": lambda: torch.full((len(tensors), width), 0, dtype=values.dtype),
        "    real_token_mask + from_host": lambda: torch.from_numpy(
            real_token_mask(lengths, width, "right")
        ),
        "    data[mask] = values (torch)": lambda: data.__setitem__(mask, values),
        "prototype (total)": lambda: prototype_pad_tensors(tensors),
        "    one-pass checks": one_pass_checks,
        "    torch.cat under no_grad": cat_no_grad,
        "    data.numpy()[mask] = values.numpy()": numpy_view_assign,
        "    data.masked_scatter_(mask, values)": lambda: data.masked_scatter_(mask, values),
    }
    print_table(
        "breakdown: batchkit.pad from tensors, by stage",
        measure(cases, repeats=repeats, min_time=min_time),
    )


# --------------------------------------------------------------------------- baseline


def load_baseline(path: str) -> ModuleType:
    """The ``batchkit`` package of another checkout, imported beside this one: its
    modules are loaded under their own names while this checkout's are set aside, then
    both are put back (each module keeps the functions it imported at load time)."""
    root = str(Path(path).resolve())
    if not (Path(root) / "batchkit" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {path}: no batchkit/ package there")
    ours = {k: v for k, v in sys.modules.items() if k == "batchkit" or k.startswith("batchkit.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        base = importlib.import_module("batchkit")
        for sub in ("collate", "collate.collators", "collate.pad", "collate.pack"):
            importlib.import_module(f"batchkit.{sub}")
    finally:
        sys.path.remove(root)
        theirs = [k for k in sys.modules if k == "batchkit" or k.startswith("batchkit.")]
        for name in theirs:
            del sys.modules[name]
        sys.modules.update(ours)
    if not Path(base.__file__ or "").resolve().is_relative_to(root):
        raise SystemExit(f"--baseline {path}: imported {base.__file__} instead")
    return base


def baseline_cases(
    new: ModuleType, old: ModuleType, lists: list[list[int]], tensors: list[torch.Tensor]
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """(this code, the baseline's) per numpy/torch case, the calls users make most."""
    arrays = [np.asarray(s) for s in lists]
    feats_list = [{"input_ids": s, "label": i % 2} for i, s in enumerate(lists)]
    feats_tensor = [{"input_ids": t, "label": i % 2} for i, t in enumerate(tensors)]
    ids_list = [{"input_ids": s} for s in lists]
    ids_tensor = [{"input_ids": t} for t in tensors]
    rows = [{"x": a[:8], "n": i} for i, a in enumerate(arrays)]

    def both(call: Callable[[ModuleType], Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        return (lambda: call(new)), (lambda: call(old))

    pad_new = new.PadCollator(return_tensors="pt")
    pad_old = old.PadCollator(return_tensors="pt")
    flat_new = new.VarlenCollator(return_tensors="pt")
    flat_old = old.VarlenCollator(return_tensors="pt")
    return {
        "pad, lists -> numpy": both(lambda bk: bk.pad(lists)),
        "pad, numpy arrays": both(lambda bk: bk.pad(arrays, side="left", pad_to_multiple_of=8)),
        "pad, torch tensors": both(lambda bk: bk.pad(tensors)),
        "pack_varlen, lists -> torch": both(lambda bk: bk.pack_varlen(lists, return_tensors="pt")),
        "pack_varlen, torch tensors": both(lambda bk: bk.pack_varlen(tensors)),
        "pack, numpy arrays": both(lambda bk: bk.pack(arrays, 1024)),
        "pack, torch tensors": both(lambda bk: bk.pack(tensors, 1024)),
        "stack, dicts of numpy": both(lambda bk: bk.stack(rows)),
        "PadCollator, lists -> torch": (
            (lambda: pad_new(feats_list)),
            (lambda: pad_old(feats_list)),
        ),
        "PadCollator, tensors": ((lambda: pad_new(feats_tensor)), (lambda: pad_old(feats_tensor))),
        # input_ids alone: a baseline before keys were carried drops "label" unread
        "VarlenCollator, lists -> torch": (
            (lambda: flat_new(ids_list)),
            (lambda: flat_old(ids_list)),
        ),
        "VarlenCollator, tensors": ((lambda: flat_new(ids_tensor)), (lambda: flat_old(ids_tensor))),
    }


def run_baseline(
    path: str, lists: list[list[int]], tensors: list[torch.Tensor], repeats: int, min_time: float
) -> list[bool]:
    """Each case, this code against the baseline's, interleaved; PASS at >= 0.95x."""
    old = load_baseline(path)
    results = []
    print(f"\n## this checkout against the baseline {path} (>= 0.95x as fast each)")
    for label, (ours, theirs) in baseline_cases(batchkit, old, lists, tensors).items():
        timings = measure({"this": ours, "baseline": theirs}, repeats=repeats, min_time=min_time)
        r, q1, q3 = speedup(timings["baseline"], timings["this"])
        times = f"{timings['this'].median * 1e6:.0f} vs {timings['baseline'].median * 1e6:.0f} us"
        results.append(report_target(f"{label} ({times})", r, (q1, q3), goal=0.95))
    return results


# --------------------------------------------------------------------------- JAX


def jnp_pad_loop(items: Sequence[Any]) -> tuple[Any, Any]:
    """The hand-written JAX idiom: ``jnp.pad`` each item to the longest, stack, and a
    mask from the lengths."""
    import jax.numpy as jnp

    width = max(int(x.shape[0]) for x in items)
    data = jnp.stack([jnp.pad(x, (0, width - int(x.shape[0]))) for x in items])
    lengths = jnp.asarray([int(x.shape[0]) for x in items])
    return data, jnp.arange(width)[None, :] < lengths[:, None]


def run_jax(lists: list[list[int]], repeats: int, min_time: float) -> None:
    """batchkit on JAX arrays against the hand-written jnp loops (results checked equal
    first; every call waits for its arrays, JAX dispatching asynchronously)."""
    if importlib.util.find_spec("jax") is None:
        print('\n## JAX: skipped (pip install -e ".[jax]")')
        return
    import jax
    import jax.numpy as jnp

    items = [jnp.asarray(s, dtype=jnp.int32) for s in lists]
    ours = batchkit.pad(items)
    data, mask = jnp_pad_loop(items)
    assert bool(jnp.array_equal(ours.data, data)) and bool(jnp.array_equal(ours.mask, mask))

    def ready(*arrays: Any) -> None:
        jax.block_until_ready(arrays)

    cases = {
        "batchkit.pad": lambda: ready(*_data_mask(batchkit.pad(items))),
        "jnp.pad per item + stack + mask": lambda: ready(*jnp_pad_loop(items)),
        "batchkit.pack_varlen": lambda: ready(batchkit.pack_varlen(items).values),
        "jnp.concatenate": lambda: ready(jnp.concatenate(items)),
    }
    timings = measure(cases, repeats=repeats, min_time=min_time)
    print_table(f"JAX {jax.__version__} ({jax.default_backend()}), int32 items", timings)
    r, q1, q3 = speedup(timings["jnp.pad per item + stack + mask"], timings["batchkit.pad"])
    print(f"info  JAX pad, batchkit.pad vs the jnp loop: {r:.2f}x (IQR {q1:.2f}-{q3:.2f})")


# --------------------------------------------------------------------------- checks


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def check_outputs(
    lists: list[list[int]], tensors: list[torch.Tensor], hf_pad: Any, hf_flat: Any
) -> None:
    """Every system in the table builds the same batch (else the timing is meaningless)."""
    feats = [{"input_ids": s} for s in lists]
    ref_data, ref_mask = batchkit_pad(lists)
    for name, (data, mask) in {
        "pad(tensors)": batchkit_pad(tensors),
        "pad_sequence+mask": pad_sequence_with_mask(tensors),
        "pad_sequence+mask (lists)": pad_sequence_from_lists(lists),
    }.items():
        assert _equal(data, ref_data) and _equal(mask, ref_mask), name
    for side in ("right", "left"):
        ours = batchkit.pad(tensors, side=side, return_tensors="pt")
        proto = prototype_pad_tensors(tensors, side=side)
        assert _equal(proto.data, ours.data) and _equal(proto.mask, ours.mask), side
        assert _equal(proto.lengths, ours.lengths), side
        assert proto.unpad(proto.data)[5].tolist() == tensors[5].tolist(), side
    for name, out in {
        "HF DataCollatorWithPadding": hf_pad(feats),
        "PadCollator": batchkit.PadCollator(return_tensors="pt")(feats),
    }.items():
        assert _equal(out["input_ids"], ref_data), name
        assert _equal(out["attention_mask"], ref_mask.long()), name

    ref = hf_flat(feats)
    ours = batchkit.VarlenCollator(return_tensors="pt")(feats)
    assert ours.keys() == ref.keys(), (ours.keys(), ref.keys())
    for key in ref:
        assert _equal(ours[key], ref[key]), key
    for seqs in (lists, tensors):
        v = batchkit.pack_varlen(seqs, return_tensors="pt")
        assert _equal(v.values, ref["input_ids"][0])
        assert _equal(v.cu_seqlens, ref["cu_seq_lens_q"])
        assert _equal(v.position_ids, ref["position_ids"][0])
        assert v.max_seqlen == ref["max_length_q"]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats (~10 s)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 25, quick 9)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per batch (64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument(
        "--prototype", action="store_true", help="also time the prototype fast pad for tensors"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="time batchkit.pad's stages on tensors"
    )
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="a checkout of an earlier batchkit: time this code against it, interleaved",
    )
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX section")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (9 if args.quick else 25)
    min_time = 0.01 if args.quick else 0.03
    start = time.perf_counter()

    lists, tensors = make_workload(args.batch, args.seed)
    lengths = np.array([len(s) for s in lists])
    hf_pad, hf_flat = hf_collators()
    check_outputs(lists, tensors, hf_pad, hf_flat)
    feats_list = [{"input_ids": s} for s in lists]
    feats_tensor = [{"input_ids": t} for t in tensors]
    pad_collator = batchkit.PadCollator(return_tensors="pt")
    varlen_collator = batchkit.VarlenCollator(return_tensors="pt")

    print(
        f"batchkit {batchkit.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); {len(lists)} sequences, "
        f"{int(lengths.sum())} tokens, lengths {int(lengths.min())}..{int(lengths.max())} "
        f"(median {int(np.median(lengths))}); padded batch {len(lists)}x{int(lengths.max())}; "
        f"{repeats} interleaved rounds"
    )

    HF_PAD, HF_FLAT = "HF DataCollatorWithPadding", "HF DataCollatorWithFlattening"
    PADSEQ = "pad_sequence + mask"
    pad_lists = {
        "batchkit.pad": lambda: batchkit_pad(lists),
        "batchkit.PadCollator": lambda: pad_collator(feats_list),
        PADSEQ + " (torch.tensor per item)": lambda: pad_sequence_from_lists(lists),
        HF_PAD: lambda: hf_pad(feats_list),
        "floor: one list->tensor conversion": lambda: list_floor(lists),
    }
    pad_tensors = {
        "batchkit.pad": lambda: batchkit_pad(tensors),
        "batchkit.PadCollator": lambda: pad_collator(feats_tensor),
        PADSEQ: lambda: pad_sequence_with_mask(tensors),
        HF_PAD: lambda: hf_pad(feats_tensor),
        "floor: torch.cat": lambda: cat_floor(tensors),
    }
    if args.prototype:
        pad_tensors["prototype pad (this file)"] = lambda: _data_mask(
            prototype_pad_tensors(tensors)
        )
    varlen_lists = {
        "batchkit.pack_varlen": lambda: batchkit.pack_varlen(lists, return_tensors="pt"),
        "batchkit.VarlenCollator": lambda: varlen_collator(feats_list),
        HF_FLAT: lambda: hf_flat(feats_list),
        "floor: one list->tensor conversion": lambda: list_floor(lists),
    }
    varlen_tensors = {
        "batchkit.pack_varlen": lambda: batchkit.pack_varlen(tensors, return_tensors="pt"),
        "batchkit.VarlenCollator": lambda: varlen_collator(feats_tensor),
        HF_FLAT: lambda: hf_flat(feats_tensor),
        "floor: torch.cat": lambda: cat_floor(tensors),
    }
    # One interleaved measurement per input form: the ratios between sections are
    # not compared, so each section only needs its own systems interleaved.
    sections: list[tuple[str, dict[str, Timing], str]] = []
    for title, cases, baseline in (
        ("pad, from python lists", pad_lists, HF_PAD),
        ("pad, from torch int64 tensors", pad_tensors, PADSEQ),
        ("varlen, from python lists", varlen_lists, HF_FLAT),
        ("varlen, from torch int64 tensors", varlen_tensors, HF_FLAT),
    ):
        timings = measure(cases, repeats=repeats, min_time=min_time)
        print_table(title, timings, baseline)
        sections.append((title, timings, baseline))

    pl, pt, vl, _ = (s[1] for s in sections)
    print("\n## targets")
    results = []
    for name in ("batchkit.pad", "batchkit.PadCollator"):
        r, q1, q3 = speedup(pl[HF_PAD], pl[name])
        results.append(report_target(f"pad from lists, {name} vs {HF_PAD}", r, (q1, q3), goal=10.0))
    for name in ("batchkit.pack_varlen", "batchkit.VarlenCollator"):
        r, q1, q3 = speedup(vl[HF_FLAT], vl[name])
        results.append(
            report_target(f"varlen from lists, {name} vs {HF_FLAT}", r, (q1, q3), goal=3.0)
        )
    r, q1, q3 = speedup(pt[PADSEQ], pt["batchkit.pad"])
    results.append(
        report_target(
            f"pad from tensors, batchkit.pad vs {PADSEQ}", r, (q1, q3), goal=1.0, band=NOISE_BAND
        )
    )
    if args.prototype:
        r, q1, q3 = speedup(pt[PADSEQ], pt["prototype pad (this file)"])
        print(f"info  pad from tensors, prototype vs {PADSEQ}: {r:.2f}x (IQR {q1:.2f}-{q3:.2f})")
        r, q1, q3 = speedup(pt["batchkit.pad"], pt["prototype pad (this file)"])
        print(
            f"info  pad from tensors, prototype vs batchkit.pad: {r:.2f}x (IQR {q1:.2f}-{q3:.2f})"
        )
    if args.breakdown:
        breakdown_pad_tensors(tensors, repeats, min_time)
    if args.baseline:
        results += run_baseline(args.baseline, lists, tensors, repeats, min_time)
    if not args.no_jax:
        run_jax(lists, repeats, min_time)
    print(
        f"\n{sum(results)}/{len(results)} targets met; took {time.perf_counter() - start:.1f} s "
        f"(times are per call; the ratios, not the times, carry across machines)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
