"""`batchkit simulate`: replay arrivals against batcher settings before deploying them."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from batchkit.batchers import DynamicBatcher
from batchkit.batchers.cost import COST_NAMES, CostLike
from batchkit.cli._args import (
    CliError,
    float_list,
    int_list,
    non_negative_float,
    positive_float,
    positive_int,
)
from batchkit.collate.shapes import ShapeBuckets
from batchkit.tools.progress import Progress
from batchkit.tools.simulate import (
    DEFAULT_MAX_WAIT_MS,
    POLICIES,
    LatencyModel,
    ShapeCost,
    SimResult,
    SimulationWarning,
    poisson_arrivals,
    read_lengths,
    read_trace,
    read_trace_groups,
    read_trace_keys,
    read_trace_lengths,
    sample_duplicates,
    sample_groups,
    sample_lengths,
    simulate,
)


def add_parser(commands: Any) -> None:
    """Register the command.

    Args:
        commands: The ``add_subparsers()`` object of the ``batchkit`` parser.
    """
    p: argparse.ArgumentParser = commands.add_parser(
        "simulate",
        help="replay Poisson or traced arrivals against batcher settings (simulated time)",
        description=(
            "Drive batchkit's own scheduler with simulated time: requests arrive (Poisson at "
            "--rate, or the times in --trace), batches run for a + b x size + c x cost ms "
            "(or as a profile file says). Prints throughput, p50/p99/p99.9 latency and the "
            "batch-size histogram; with --max-latency-ms, the requests refused or shed and "
            "the goodput; with --groups, the groups per batch and each group's p99; with "
            "--grid-batch-sizes and --grid-lengths, the shapes compiled and the padding paid "
            "beside the same run without the grid. "
            "Comma-separated --max-batch-size/--max-wait-ms/--max-concurrent-batches/"
            "--max-groups-per-batch values give one table row per combination."
        ),
    )
    arrivals = p.add_mutually_exclusive_group(required=True)
    arrivals.add_argument("--rate", type=positive_float, help="Poisson arrivals, requests/s")
    arrivals.add_argument("--trace", metavar="FILE",
                          help="arrival times in seconds, one per line")  # fmt: skip
    p.add_argument("--requests", type=positive_int, default=10_000,
                   help="Poisson arrivals to simulate (default 10000)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--policy", choices=POLICIES, default="dynamic",
                   help="DynamicBatcher, StaticBatcher, BucketedBatcher or SortedBatcher "
                        "(default dynamic; bucketed and sorted need request lengths)")  # fmt: skip
    p.add_argument("--max-batch-size", type=int_list,
                   help="default 32 (with a shape grid, its largest batch size)")  # fmt: skip
    p.add_argument("--max-wait-ms", type=float_list,
                   help="default 5 (not for --policy static, which waits until full)")  # fmt: skip
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="dynamic: an idle device takes a partial batch at once (default); "
                        "--no-eager waits for a full batch or --max-wait-ms even when idle, "
                        "as Triton and Ray Serve do")  # fmt: skip
    p.add_argument("--buckets", type=positive_int,
                   help="bucketed: this many buckets of equal tokens, cut from the lengths "
                        "(default up to 4)")  # fmt: skip
    p.add_argument("--max-concurrent-batches", type=int_list, default=[1],
                   help="batches running at once, each as if alone (default 1)")  # fmt: skip
    p.add_argument("--max-queue-size", type=positive_int,
                   help="waiting requests beyond this are rejected (QueueFull)")  # fmt: skip
    target = p.add_argument_group("latency target")
    target.add_argument("--max-latency-ms", type=positive_float,
                        help="each request's target, as @batched(max_latency_ms=): requests "
                             "predicted late are refused, waiting ones that can no longer be "
                             "in time are shed (Overloaded)")  # fmt: skip
    target.add_argument("--goodput-ms", type=positive_float,
                        help="count answers within this many ms as goodput (default "
                             "--max-latency-ms; give it alone to see an untargeted run's "
                             "goodput)")  # fmt: skip
    budget = p.add_argument_group("request lengths (token budget, buckets, cost term)")
    lengths = budget.add_mutually_exclusive_group()
    lengths.add_argument("--lengths", metavar="FILE",
                         help="request lengths, one int per line: each request draws one "
                              "at random (with --seed)")  # fmt: skip
    lengths.add_argument("--length-dist", metavar="SPEC",
                         help="lengths drawn from uniform:LO,HI or lognormal:MEDIAN,SIGMA "
                              "(with --seed)")  # fmt: skip
    lengths.add_argument("--trace-lengths", action="store_true",
                         help="each request's length: the --trace CSV's second column")  # fmt: skip
    budget.add_argument("--max-tokens", type=positive_int,
                        help="the most a batch may cost, by --cost (needs lengths)")  # fmt: skip
    budget.add_argument("--cost", choices=COST_NAMES, default=None,
                        help="what --max-tokens bounds and --per-cost-ms counts: padded = "
                             "batch size x longest (default), sum = total tokens (packed, "
                             "padding-free)")  # fmt: skip
    grouped = p.add_argument_group("groups (adapters, models, tasks: max_groups_per_batch)")
    group_source = grouped.add_mutually_exclusive_group()
    group_source.add_argument("--groups", type=group_spec, metavar="N|NAME=WEIGHT,...",
                              help="each request's group, drawn (with --seed): N groups "
                                   "0..N-1 (by --group-skew), or NAME=WEIGHT pairs such as "
                                   "a=3,b=1")  # fmt: skip
    group_source.add_argument("--trace-groups", action="store_true",
                              help="each request's group: the --trace CSV's column headed "
                                   "'group'")  # fmt: skip
    grouped.add_argument("--group-skew", type=non_negative_float, metavar="SKEW",
                         help="--groups N: group k is drawn with weight 1 / (k + 1)^SKEW "
                              "(Zipf; default 0: evenly)")  # fmt: skip
    grouped.add_argument("--max-groups-per-batch", type=int_list,
                         help="the most groups in one batch (default 1; comma-separated "
                              "values sweep)")  # fmt: skip
    _add_duplicate_options(p)
    _add_grid_options(p)
    model = p.add_argument_group("latency model (default 5 ms + 0.5 ms x batch size)")
    model.add_argument("--latency-ms", type=non_negative_float, help="a: fixed cost of a batch")
    model.add_argument("--per-item-ms", type=non_negative_float, help="b: cost per item")
    model.add_argument("--per-cost-ms", type=non_negative_float,
                       help="c: cost per unit of a batch's cost, by --cost (per token; "
                            "needs lengths; default 0)")  # fmt: skip
    model.add_argument("--switch-ms", type=non_negative_float,
                       help="s: cost of each group past the first in a batch (needs "
                            "groups; default 0)")  # fmt: skip
    model.add_argument("--profile", metavar="FILE.json",
                       help="a 'batchkit profile --json' file instead of a + b x size")  # fmt: skip
    p.set_defaults(run=run)


LENGTH_OPTIONS = "--lengths, --length-dist or --trace-lengths"
GROUP_OPTIONS = "--groups or --trace-groups"


def _add_duplicate_options(p: argparse.ArgumentParser) -> None:
    """The options of identical requests (`@batched(coalesce=...)`)."""
    shared = p.add_argument_group("identical requests (coalesce: the device work saved)")
    source = shared.add_mutually_exclusive_group()
    source.add_argument("--duplicates", type=positive_int, metavar="N",
                        help="each request's key drawn (with --seed) from N keys by "
                             "--duplicate-skew; a request whose key is waiting or running "
                             "joins it, as @batched(coalesce=...) does")  # fmt: skip
    source.add_argument("--trace-keys", action="store_true",
                        help="each request's key: the --trace CSV's column headed 'key' "
                             "(a query, a document's hash)")  # fmt: skip
    shared.add_argument("--duplicate-skew", type=non_negative_float, metavar="SKEW",
                        help="--duplicates N: key k is drawn with weight 1 / (k + 1)^SKEW "
                             "(Zipf; default 1)")  # fmt: skip


def _add_grid_options(p: argparse.ArgumentParser) -> None:
    """The options of a static shape grid (`@batched(shapes=ShapeBuckets(...))`)."""
    grid = p.add_argument_group(
        "static shapes (a ShapeBuckets grid: the shapes compiled against the padding paid)"
    )
    grid.add_argument("--grid-batch-sizes", type=int_list, metavar="B,B,...",
                      help="the grid's batch sizes, such as 1,2,4,8: each batch is padded "
                           "up to one (needs --grid-lengths)")  # fmt: skip
    grid.add_argument("--grid-lengths", type=int_list, metavar="L,L,...",
                      help="the grid's lengths, such as 64,128,256: a request joins the "
                           "bucket of the length it pads to (needs request lengths)")  # fmt: skip


def _grid(args: argparse.Namespace) -> ShapeBuckets | None:
    """The shape grid of ``--grid-batch-sizes`` and ``--grid-lengths``; None without."""
    sizes, lengths = args.grid_batch_sizes, args.grid_lengths
    if sizes is None and lengths is None:
        return None
    if sizes is None or lengths is None:
        given, missing = (
            ("--grid-lengths", "--grid-batch-sizes")
            if sizes is None
            else ("--grid-batch-sizes", "--grid-lengths")
        )
        raise CliError(f"{given} is one axis of a shape grid: give {missing} too")
    if args.policy not in ("dynamic", "bucketed"):
        raise CliError(
            f"a shape grid is for --policy dynamic or bucketed, not {args.policy} (the grid "
            "sets the batch sizes and the length buckets)"
        )
    if args.buckets is not None:
        raise CliError("--buckets and a shape grid both cut the lengths: the grid's lengths "
                       "are the buckets; give --grid-lengths alone")  # fmt: skip
    if not (args.lengths or args.length_dist or args.trace_lengths):
        raise CliError(f"a shape grid pads each request to a grid length: give {LENGTH_OPTIONS}")
    grid = ShapeBuckets(batch_sizes=sizes, lengths=lengths)
    below = [size for size in args.max_batch_size or () if size < grid.max_batch_size]
    if below:
        raise CliError(
            f"--max-batch-size {below[0]} is below the grid's largest batch size "
            f"({grid.max_batch_size}): the grid's batch sizes set the largest batch (leave "
            "--max-batch-size out)"
        )
    return grid


def _duplicates(args: argparse.Namespace, count: int) -> tuple[list[Hashable] | None, str]:
    """Each request's coalescing key, and where it came from; None without them."""
    if args.trace_keys:
        if args.trace is None:
            raise CliError("--trace-keys reads the keys from --trace FILE: give --trace")
        _, traced = read_trace_keys(args.trace)
        return list(traced), f"keys from the key column of {args.trace}"
    if args.duplicate_skew is not None and args.duplicates is None:
        raise CliError("--duplicate-skew is the Zipf skew of --duplicates N: give --duplicates")
    if args.duplicates is None:
        return None, ""
    skew = 1.0 if args.duplicate_skew is None else args.duplicate_skew
    drawn: list[Hashable] = list(sample_duplicates(args.duplicates, count, args.seed, skew=skew))
    return drawn, f"keys drawn from {args.duplicates} keys (Zipf skew {skew:g})"


def group_spec(text: str) -> int | dict[str, float]:
    """``"12"`` -> 12 groups; ``"a=3,b=1"`` -> each group's weight.

    Args:
        text: The command-line word.

    Raises:
        argparse.ArgumentTypeError: It is neither (argparse prints the message).
    """
    expected = "a number of groups such as 12, or NAME=WEIGHT pairs such as a=3,b=1"
    text = text.strip()
    if "=" not in text:
        try:
            count = positive_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        return count
    weights: dict[str, float] = {}
    for pair in (p for p in re.split(r"[,\s]+", text) if p):
        name, _, weight = (part.strip() for part in pair.partition("="))
        if not name or not weight:
            where = "" if pair == text else f" in {text!r}"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {pair!r}{where}")
        if name in weights:
            raise argparse.ArgumentTypeError(f"group {name!r} is given twice in {text!r}")
        try:
            weights[name] = non_negative_float(weight)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"group {name!r}: its weight must be a number >= 0, got {weight!r}"
            ) from None
    if not any(weights.values()):
        raise argparse.ArgumentTypeError(f"every group's weight is 0 in {text!r}")
    return weights


def _latency_model(args: argparse.Namespace) -> LatencyModel:
    linear = args.latency_ms is not None or args.per_item_ms is not None
    per_cost = 0.0 if args.per_cost_ms is None else args.per_cost_ms
    switch = 0.0 if args.switch_ms is None else args.switch_ms
    if args.profile is not None:
        if linear:
            raise CliError("give either --profile or --latency-ms/--per-item-ms, not both")
        return LatencyModel.from_profile(args.profile, per_cost_ms=per_cost, switch_ms=switch)
    fixed = 5.0 if args.latency_ms is None else args.latency_ms
    per_item = 0.5 if args.per_item_ms is None else args.per_item_ms
    return LatencyModel.linear(fixed, per_item, per_cost, switch_ms=switch)


def _noisy_profile_warning(path: str) -> str | None:
    """The warning for a profile whose own report found its timings too noisy to pick a
    knee (``knee_determined`` false in its JSON); None for a settled one."""
    data = json.loads(Path(path).read_text())  # (read once already: from_profile)
    if data.get("knee_determined", True):
        return None
    low, high = data.get("knee_range", ("?", "?"))
    return (
        f"{path}: batchkit profile found these timings too noisy to pick a knee (anywhere "
        f"from {low} to {high}); the batch times below are as uncertain (profile again "
        "with a larger --budget-s or --max-repeats, on a quieter machine)"
    )


def _check_options(args: argparse.Namespace) -> None:
    """Options that need another one, or a policy."""
    has_lengths = args.lengths is not None or args.length_dist is not None or args.trace_lengths
    if args.cost is not None and args.max_tokens is None and args.per_cost_ms is None:
        raise CliError(
            "--cost says what --max-tokens bounds and --per-cost-ms counts: give --max-tokens "
            "too (or --per-cost-ms)"
        )
    if args.trace_lengths and args.trace is None:
        raise CliError("--trace-lengths reads the lengths from --trace FILE: give --trace")
    if not has_lengths:
        if args.max_tokens is not None:
            raise CliError(f"--max-tokens needs --lengths (or {LENGTH_OPTIONS}: the lengths)")
        if args.per_cost_ms:
            raise CliError(
                f"--per-cost-ms prices a batch's cost, from the requests' lengths: give "
                f"{LENGTH_OPTIONS}"
            )
        if args.policy in ("bucketed", "sorted"):
            raise CliError(
                f"--policy {args.policy} groups requests by length: give {LENGTH_OPTIONS}"
            )
    if args.policy == "static" and args.max_wait_ms is not None:
        raise CliError(
            "--max-wait-ms is not for --policy static: StaticBatcher has no max_wait_ms: it "
            "waits until a batch is full"
        )
    if args.policy == "static" and args.max_tokens is not None:
        raise CliError("--max-tokens is not for --policy static (a static batch is a fixed size)")
    if args.buckets is not None and args.policy != "bucketed":
        raise CliError("--buckets is for --policy bucketed")
    if not args.eager and args.policy != "dynamic":
        raise CliError("--no-eager is for --policy dynamic (static never leaves before full)")
    _check_group_options(args)


def _check_group_options(args: argparse.Namespace) -> None:
    """Group options that need groups, or a kind of them."""
    if args.trace_groups and args.trace is None:
        raise CliError("--trace-groups reads the groups from --trace FILE: give --trace")
    if args.group_skew is not None and not isinstance(args.groups, int):
        if args.groups is None:
            raise CliError("--group-skew is the Zipf skew of --groups N: give --groups N")
        raise CliError(
            "--group-skew is for --groups N (a number of groups): NAME=WEIGHT pairs give "
            "each group's weight"
        )
    if args.groups is None and not args.trace_groups:
        if args.max_groups_per_batch is not None:
            raise CliError(f"--max-groups-per-batch needs {GROUP_OPTIONS} (each request's group)")
        if args.switch_ms:
            raise CliError(
                f"--switch-ms prices a batch's groups past the first: give {GROUP_OPTIONS}"
            )


def _keys(
    args: argparse.Namespace, count: int, traced: list[int] | None
) -> tuple[list[float] | None, str]:
    """Each request's length, and where it came from; None without lengths."""
    if traced is not None:
        return [float(n) for n in traced], f"the second column of {args.trace}"
    if args.length_dist is not None:
        try:
            drawn = sample_lengths(args.length_dist, count, args.seed)
        except ValueError as exc:
            raise CliError(f"argument --length-dist: {exc}") from None
        return [float(n) for n in drawn], f"lengths drawn from {args.length_dist}"
    if args.lengths is None:
        return None, ""
    try:
        lengths = read_lengths(args.lengths)
    except ValueError as exc:
        raise CliError(f"argument --lengths: {exc}") from None
    picked = np.random.default_rng(args.seed).choice(np.asarray(lengths), size=count)
    return [float(n) for n in picked.tolist()], f"lengths drawn from {args.lengths}"


def _groups(args: argparse.Namespace, count: int) -> tuple[list[Hashable] | None, str]:
    """Each request's group, and where it came from; None without groups."""
    if args.trace_groups:
        _, traced = read_trace_groups(args.trace)
        return list(traced), f"groups from the group column of {args.trace}"
    if args.groups is None:
        return None, ""
    skew = 0.0 if args.group_skew is None else args.group_skew
    drawn = sample_groups(args.groups, count, args.seed, skew=skew)
    if isinstance(args.groups, int):
        how = f"Zipf skew {skew:g}" if skew else "evenly"
        return drawn, f"groups drawn from {args.groups} groups ({how})"
    weights = ",".join(f"{name}={weight:g}" for name, weight in args.groups.items())
    return drawn, f"groups drawn from {weights}"


def _describe_groups(groups: list[Hashable]) -> str:
    """How many groups, and the share of the most requested one."""
    counts: dict[Hashable, int] = {}
    for group in groups:
        counts[group] = counts.get(group, 0) + 1
    top = max(counts, key=counts.__getitem__)
    return (
        f"{len(counts):,} groups, the most requested {top} ({counts[top] / len(groups):.0%} "
        "of requests)"
    )


def run(args: argparse.Namespace) -> int:
    """Simulate every combination of settings; details for one, a table for several.

    Args:
        args: The parsed command line.

    Returns:
        0.

    Raises:
        CliError: Conflicting options (e.g. ``--profile`` with ``--latency-ms``).
    """
    _check_options(args)
    grid = _grid(args)
    model = _latency_model(args)
    traced: list[int] | None = None
    if args.trace is not None:
        if args.trace_lengths:
            times, traced = read_trace_lengths(args.trace)
        else:
            times = read_trace(args.trace)
        source = f"{len(times)} arrivals from {args.trace}"
    else:
        try:
            times = poisson_arrivals(args.rate, args.requests, args.seed)
        except ValueError as exc:  # a rate too low for finite arrival times
            raise CliError(f"argument --rate: {exc}") from None
        except MemoryError:
            raise CliError(
                f"argument --requests: not enough memory for {args.requests:,} requests"
            ) from None
        source = f"{len(times)} Poisson arrivals at {args.rate:g} req/s (seed {args.seed})"
    keys, lengths_source = _keys(args, len(times), traced)
    groups, groups_source = _groups(args, len(times))
    duplicates, duplicates_source = _duplicates(args, len(times))
    cost: CostLike = "sum" if args.cost == "sum" else "padded"
    waits: list[float | None] = list(args.max_wait_ms or [DEFAULT_MAX_WAIT_MS])
    if args.policy == "static":
        waits = [None]  # it has none (a wait given was refused above)
    limits: list[int | None] = list(args.max_groups_per_batch or [None])  # None: the default, 1
    sizes = args.max_batch_size or [32 if grid is None else grid.max_batch_size]
    # With a grid, each setting runs without it, then with it: the cost of the grid.
    grids = [None] if grid is None else [None, grid]
    settings = list(
        itertools.product(sizes, waits, args.max_concurrent_batches, limits, grids)
    )
    combos = [(size, wait, slots) for size, wait, slots, _, _ in settings]
    results = []
    with (
        Progress("simulating", len(combos), enabled=sys.stderr.isatty() and len(combos) > 1) as bar,
        warnings.catch_warnings(),
    ):
        # Printed below, once, in the report itself (SimResult.warnings), not as Python's
        # warning lines on stderr for every row of a sweep.
        warnings.simplefilter("ignore", SimulationWarning)
        for size, wait, slots, limit, shapes in settings:
            results.append(
                simulate(
                    model,
                    arrivals=times,
                    batcher=None
                    if args.eager
                    else DynamicBatcher(
                        size,
                        DEFAULT_MAX_WAIT_MS if wait is None else wait,
                        eager=False,
                        max_tokens=args.max_tokens,
                        cost=cost,
                        key=None if keys is None else len,
                        # (Never called: simulate gives each request its group.)
                        group=None if groups is None else groups.__getitem__,
                        max_groups_per_batch=limit,
                        shapes=shapes,
                    ),
                    policy=args.policy,
                    max_batch_size=size,
                    max_wait_ms=wait if args.eager else None,
                    max_concurrent_batches=slots,
                    max_queue_size=args.max_queue_size,
                    max_latency_ms=args.max_latency_ms,
                    goodput_ms=args.goodput_ms,
                    keys=keys,
                    max_tokens=args.max_tokens if args.eager else None,
                    cost=cost if args.eager else "padded",
                    buckets=args.buckets,
                    groups=groups,
                    max_groups_per_batch=limit if args.eager else None,
                    duplicates=duplicates,
                    shapes=shapes if args.eager else None,
                )
            )
            bar.advance()
    print(f"{source}; latency model {model.description}")
    if keys is not None:
        print(f"{lengths_source}: mean {sum(keys) / len(keys):,.1f}")
    if groups is not None:
        print(f"{groups_source}: {_describe_groups(groups)}")
    if duplicates is not None:
        distinct = len(set(duplicates))
        print(f"{duplicates_source}: {distinct:,} distinct in {len(duplicates):,} requests")
    if not args.eager:
        print("not eager: a batch waits for full or --max-wait-ms even when nothing runs")
    if args.max_latency_ms is not None:
        print(
            f"latency target {args.max_latency_ms:g} ms: requests predicted late are refused, "
            "waiting ones that can no longer be in time are shed (Overloaded)"
        )
    noisy = None if args.profile is None else _noisy_profile_warning(args.profile)
    if noisy is not None:
        print(f"warning: {noisy}")
    for message in dict.fromkeys(w for r in results for w in r.warnings):
        print(f"warning: {message}")
    if grid is not None:
        print(f"shape grid {_grid_name(grid)}: {len(grid.cells)} cells")
    if len(results) == 1 or (grid is not None and len(results) == 2):
        print(format_result(results[-1]))
        if grid is not None:
            print("\n".join(format_shapes(results[0], results[1])))
    else:
        print(format_table(combos, results))
    return 0


def format_table(combos: list[tuple[int, float | None, int]], results: list[SimResult]) -> str:
    """One row per setting: the latency/throughput trade-off at a glance.

    With a latency target or a goodput threshold, each row adds the goodput (req/s
    and % of offered) and the requests refused and shed. With groups, each row adds
    its `max_groups_per_batch` (after the slots), the mean groups per batch, and the
    worst group's p99 and name (last). With a shape grid, each setting has a row
    without the grid and one with it (``grid`` no / yes), each with the shapes its
    batches were called with and the padded tokens over the real ones.

    Args:
        combos: ``(max_batch_size, max_wait_ms, max_concurrent_batches)`` per run
            (``max_wait_ms`` None for a policy without one, shown as ``-``).
        results: The runs' results, in the same order.
    """
    good = any(r.goodput_ms is not None for r in results)
    grouped = any(r.max_groups_per_batch is not None for r in results)
    gridded = any(r.shape_cost is not None and r.shape_cost.grid for r in results)
    head = f"{'max_batch':>9}{'wait ms':>8}{'slots':>6}"
    if grouped:
        head += f"{'groups':>7}"
    if gridded:
        head += f"{'grid':>5}"
    head += f"{'req/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'p99.9 ms':>9}{'batch':>7}{'busy':>6}"
    if gridded:
        head += f"{'shapes':>8}{'padded':>8}"
    if good:
        head += f"{'goodput':>9}{'good':>6}{'refused':>9}{'shed':>7}"
    if grouped:
        head += f"{'grp/b':>6}{'worst p99':>10}  group"
    lines = [head]
    figures = []  # each row without its settings
    for (size, wait, slots), r in zip(combos, results):
        shown = "-" if wait is None else f"{wait:g}"
        row = f"{size:>9}{shown:>8}{slots:>6}"
        if grouped:
            row += f"{r.max_groups_per_batch:>7}"
        if gridded:
            row += f"{'no' if r.shape_cost is None or r.shape_cost.grid is None else 'yes':>5}"
        settings_width = len(row)
        row += (
            f"{r.throughput:>9,.0f}{r.latency.p50:>8.1f}"
            f"{r.latency.p99:>8.1f}{r.latency.p999:>9.1f}{r.mean_batch_size:>7.1f}"
            f"{r.utilization:>6.0%}"
        )
        if gridded and r.shape_cost is not None:
            row += f"{r.shape_cost.compiled:>8,}{r.shape_cost.padding:>7.2f}x"
        if good:
            row += f"{r.goodput:>9,.0f}{r.goodput_fraction:>6.0%}{r.overloaded:>9,}{r.shed:>7,}"
        if grouped:
            worst = "-" if r.worst_group is None else str(r.worst_group)
            row += f"{r.mean_groups_per_batch:>6.2f}{r.worst_group_p99:>10.1f}  {worst}"
        lines.append(row)
        figures.append(row[settings_width:])
    twins = _identical_runs(figures)
    for index, r in enumerate(results):
        twin = next((n for n, rows in enumerate(twins, 1) if index in rows), None)
        lines[index + 1] += _overload_mark(r) + ("" if twin is None else f"  (={twin})")
    if any(_overload_mark(r) for r in results):
        lines.append(f"(!) overloaded: arrivals exceed capacity, {_excess(results[0])}")
    for number, rows in enumerate(twins, 1):
        lines.append(
            f"(={number}) {_why_identical([combos[i] for i in rows], [results[i] for i in rows])}"
        )
    return "\n".join(lines)


def _identical_runs(figures: list[str]) -> list[list[int]]:
    """The indices of rows whose figures print the same, in groups of two or more."""
    by_result: dict[str, list[int]] = {}
    for index, printed in enumerate(figures):
        by_result.setdefault(printed, []).append(index)
    return [indices for indices in by_result.values() if len(indices) > 1]


def _why_identical(combos: list[tuple[int, float | None, int]], results: list[SimResult]) -> str:
    """What made runs of different settings come out the same, where the runs say so."""
    sizes = sorted({size for size, _, _ in combos})
    waits = sorted({wait for _, wait, _ in combos if wait is not None})
    slots = sorted({slot for _, _, slot in combos})
    limits = sorted({r.max_groups_per_batch for r in results if r.max_groups_per_batch})
    differing = [
        (name, values)
        for name, values in (
            ("max_batch", sizes), ("wait ms", waits), ("slots", slots), ("groups", limits)
        )
        if len(values) > 1
    ]  # fmt: skip
    settings = " and ".join(
        f"{name} {', '.join(f'{v:g}' for v in values)}" for name, values in differing
    )
    reasons = []
    if len(waits) > 1 and not any(r.dispatch_reasons.get("max_wait") for r in results):
        reasons.append(
            "no batch waited for max wait: each left full or as soon as the model was free"
        )
    largest = max((size for r in results for size in r.batch_sizes), default=0)
    if len(sizes) > 1 and largest < sizes[0]:
        reasons.append(f"no batch reached {sizes[0]} requests, the smallest max_batch")
    most_groups = max((n for r in results for n in r.batch_groups), default=0)
    if len(limits) > 1 and most_groups < limits[0]:
        reasons.append(f"no batch held {limits[0]} groups, the smallest limit")
    if reasons and len(reasons) == len(differing):
        return f"identical figures at {settings}: " + "; ".join(reasons)
    return f"identical figures at {settings}"


def _grid_name(grid: ShapeBuckets) -> str:
    """``batch sizes 1,2,4,8 x lengths 64,128,256``."""
    return (
        f"batch sizes {','.join(map(str, grid.batch_sizes))} x lengths "
        f"{','.join(map(str, grid.lengths))}"
    )


def format_shapes(without: SimResult, with_grid: SimResult) -> list[str]:
    """What a shape grid costs, beside the same run without it: the shapes a
    compiled model is called with (each a compilation), the padded tokens over the
    real ones, the dummy rows, and the throughput and latency of each run.

    Args:
        without: The run without the grid (each batch padded to its longest).
        with_grid: The same arrivals and settings under the grid.

    Raises:
        ValueError: A run without lengths (no shapes to report), or a second run
            without a grid.
    """
    plain, cells = without.shape_cost, with_grid.shape_cost
    if plain is None or cells is None or cells.grid is None:
        raise ValueError("format_shapes needs two runs with lengths, the second under a grid")
    lines = [
        "static shapes  shapes  padded/real  dummy rows    req/s  p50 ms  p99 ms",
        _shape_row("no grid", f"{plain.compiled:,}", plain, without),
        _shape_row("grid", f"{cells.compiled} of {cells.cells}", cells, with_grid),
    ]
    unreached = [cell for cell in cells.grid.cells if cell not in cells.shapes]
    if unreached:
        shown = ", ".join(f"{b}x{n}" for b, n in unreached[:8])
        more = f" and {len(unreached) - 8} more" if len(unreached) > 8 else ""
        lines.append(f"cells never reached: {shown}{more}")
    return lines


def _shape_row(name: str, shapes: str, cost: ShapeCost, r: SimResult) -> str:
    return (
        f"  {name:<9}{shapes:>11}{cost.padding:>12.2f}x{cost.dummy_rows:>12,}"
        f"{r.throughput:>9,.0f}{r.latency.p50:>8.1f}{r.latency.p99:>8.1f}"
    )


def _overload_mark(r: SimResult) -> str:
    return "  (!)" if r.offered_rate > r.capacity else ""


def _excess(r: SimResult) -> str:
    """What becomes of the requests beyond capacity."""
    if r.max_latency_ms is None:
        return "the queue grows for as long as they last"
    return "the latency target refuses or sheds the excess"


def format_result(r: SimResult) -> str:
    """Every number of one run, and the batch-size histogram.

    Args:
        r: The run's result.
    """
    lat, wait = r.latency, r.queue_wait
    # NaN: every request arrived at one instant, which has no rate.
    offered = "n/a" if math.isnan(r.offered_rate) else f"{r.offered_rate:,.1f}"
    outcomes = [f"served {r.served} of {r.requests}"]
    if r.overloaded:
        outcomes.append(f"refused {r.overloaded} (Overloaded)")
    if r.shed:
        outcomes.append(f"shed {r.shed} while waiting (Overloaded)")
    if r.rejected:
        outcomes.append(f"rejected {r.rejected} (QueueFull)")
    throughput = (
        f"throughput    {r.throughput:,.1f} req/s (offered {offered}; capacity at "
        f"full batches {r.capacity:,.1f}; busy {r.utilization:.0%})"
    )
    lines = [f"batcher: {r.batcher}, {r.max_concurrent_batches} concurrent batch(es)"]
    if r.goodput_ms is None:
        lines += [throughput, ", ".join(outcomes)]
    else:
        # What was answered in time first: the throughput counts late answers too, and
        # under a target that cannot be met it is the least telling number.
        lines += [
            f"goodput       {r.goodput:,.1f} req/s answered within {r.goodput_ms:g} ms "
            f"({r.goodput_fraction:.1%} of offered)",
            ", ".join(outcomes),
            throughput,
        ]
    lines += [
        f"latency ms    p50 {lat.p50:.2f}  p90 {lat.p90:.2f}  p99 {lat.p99:.2f}  "
        f"p99.9 {lat.p999:.2f}  max {lat.max:.2f}",
        f"queue wait ms p50 {wait.p50:.2f}  p99 {wait.p99:.2f}  max {wait.max:.2f}",
        f"batches       {r.batches:,}, mean size {r.mean_batch_size:.2f}; dispatched: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(r.dispatch_reasons.items())),
    ]
    if not math.isnan(r.mean_batch_cost):
        gridded = r.shape_cost is not None and r.shape_cost.grid is not None
        counted = "its cell's batch size x length" if gridded else "by the policy's cost"
        lines.append(f"batch cost    mean {r.mean_batch_cost:,.1f} ({counted})")
    if r.max_groups_per_batch is not None:
        lines += _group_lines(r)
    if r.coalesced:
        lines.append(
            f"coalesced     {r.coalesced:,} requests joined one of their key waiting or "
            f"running: device rows saved {r.coalesced / r.requests:.0%}"
        )
    learned = r.learned_latency
    if learned is not None:
        # (Without lengths the scheduler sees no cost: its cost term is 0 by construction.)
        per_cost = (
            "" if math.isnan(r.mean_batch_cost) else f" + {learned.per_cost_ms:.4g} ms x cost"
        )
        lines.append(
            f"learned model {learned.fixed_ms:.2f} ms + {learned.per_item_ms:.3f} ms x size"
            f"{per_cost}, margin {learned.margin_ms:.2f} ms (what the target predicts with)"
        )
    if r.offered_rate > r.capacity:
        lines.append(f"warning: arrivals exceed capacity: {_excess(r)}")
    lines.append("batch sizes")
    lines.extend(histogram(r.batch_sizes))
    return "\n".join(lines)


def _group_lines(r: SimResult) -> list[str]:
    """The groups per batch, and the worst and best groups' p99 latency."""
    line = f"groups        {len(r.groups):,}, at most {r.max_groups_per_batch} a batch"
    if r.batch_groups:  # (none when every request was refused)
        spread = ", ".join(f"{g}: {n:,}" for g, n in r.groups_per_batch.items())
        line += f"; per batch mean {r.mean_groups_per_batch:.2f} ({spread})"
    lines = [line]
    worst = r.worst_group
    if worst is not None:
        served = {g: s for g, s in r.groups.items() if s.served}
        best = min(served, key=lambda g: served[g].latency.p99)
        lines.append(
            f"group p99 ms  worst {r.worst_group_p99:.2f} (group {worst}, "
            f"{_requests(r.groups[worst].requests)}), best {served[best].latency.p99:.2f} "
            f"(group {best}, {_requests(served[best].requests)})"
        )
    return lines


def _requests(count: int) -> str:
    return f"{count:,} request{'' if count == 1 else 's'}"


def histogram(batch_sizes: dict[int, int], width: int = 40) -> list[str]:
    """One bar per size (power-of-two ranges when there are more than 16 sizes).

    Args:
        batch_sizes: Batches run, by size.
        width: Characters of the longest bar.

    Returns:
        One line per bar: the size (or range), the bar, the count and its share.
    """
    if not batch_sizes:
        return ["  (no batches)"]
    if len(batch_sizes) <= 16:
        bins = [(str(size), count) for size, count in sorted(batch_sizes.items())]
    else:
        grouped: dict[int, int] = {}
        for size, count in batch_sizes.items():
            low = 1 << (size.bit_length() - 1)
            grouped[low] = grouped.get(low, 0) + count
        bins = [(f"{lo}-{2 * lo - 1}" if lo > 1 else "1", c) for lo, c in sorted(grouped.items())]
    total = sum(c for _, c in bins)
    top = max(c for _, c in bins)
    label_width = max(len(label) for label, _ in bins)
    return [
        f"  {label:>{label_width}} {'#' * max(1, math.ceil(width * c / top)):<{width}} "
        f"{c:>8,} {c / total:6.1%}"
        for label, c in bins
    ]
