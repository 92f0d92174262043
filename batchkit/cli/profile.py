"""``batchkit profile MODULE:CALLABLE``: latency and throughput per batch size, the knee,
and ``max_batch_size``/``max_wait_ms`` for a latency target."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchkit.cli._args import (
    CliError,
    int_list,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from batchkit.cli._args import shape as shape_arg
from batchkit.tools.profile import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_MAX_REPEATS,
    DEFAULT_TIME_BUDGET_S,
    ProfilePoint,
    ProfileResult,
    profile,
)
from batchkit.tools.progress import Progress

NEEDS_MATPLOTLIB = '--plot needs matplotlib: pip install "batchkit-ml[plot]" (or matplotlib)'


def add_parser(commands: Any) -> None:
    """Register the command.

    Args:
        commands: The ``add_subparsers()`` object of the ``batchkit`` parser.
    """
    p: argparse.ArgumentParser = commands.add_parser(
        "profile",
        help="sweep batch sizes of a batch function; find the knee; recommend settings",
        description=(
            "Call MODULE:CALLABLE on batches of shape [B, *input-shape] (a numpy array, or a "
            "torch tensor with --framework torch) for each batch size: warm-up runs, then "
            "timed rounds, every size once a round, until the knee settles or --budget-s "
            "runs out (CUDA-synchronised on GPU). Prints each size's median latency with its "
            "95% confidence interval and p10-p90 spread, the throughput, the knee (the "
            "smallest size within 5% of the peak throughput) and settings for --sla-ms; "
            "when the timings leave the knee in doubt, the range it may be in and no settings."
        ),
    )
    p.add_argument("target", metavar="MODULE:CALLABLE",
                   help="e.g. mypkg.model:predict, or path/to/file.py:predict")  # fmt: skip
    p.add_argument("--input-shape", type=shape_arg, required=True,
                   help="one item's shape without the batch axis: 128, 3,224,224")  # fmt: skip
    default_sizes = ",".join(map(str, DEFAULT_BATCH_SIZES))
    p.add_argument("--batch-sizes", type=int_list, default=list(DEFAULT_BATCH_SIZES),
                   help=f"comma-separated (default {default_sizes})")  # fmt: skip
    p.add_argument("--framework", choices=("numpy", "torch"), default="numpy",
                   help="what the callable receives (default numpy)")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--device", help="torch device (default cuda if available, else cpu)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs (default 2)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="the fewest timed runs per size (default 5)")  # fmt: skip
    p.add_argument("--max-repeats", type=positive_int, default=DEFAULT_MAX_REPEATS,
                   help=f"the most timed runs per size (default {DEFAULT_MAX_REPEATS})",
                   )  # fmt: skip
    p.add_argument("--budget-s", type=non_negative_float, default=DEFAULT_TIME_BUDGET_S,
                   help="seconds of timed rounds after which no new one starts, settled or "
                        f"not (default {DEFAULT_TIME_BUDGET_S:g})")  # fmt: skip
    p.add_argument("--sla-ms", type=positive_float, help="latency target for the recommendation")
    p.add_argument("--json", type=Path, metavar="OUT.json",
                   help="save the profile (read by 'batchkit simulate --profile')")  # fmt: skip
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="draw the curve (matplotlib)")
    p.set_defaults(run=run)


def load_callable(spec: str) -> Callable[[Any], Any]:
    """``module.path:name`` or ``file.py:name`` (dotted names allowed) -> the callable.

    The current directory is importable, as under ``python -m``.

    Args:
        spec: ``MODULE:CALLABLE``, the module as a dotted name or a ``.py`` path.

    Raises:
        CliError: A malformed ``spec``, a module that cannot be imported (the
            message quotes its error), a missing attribute, or one not callable.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected MODULE:CALLABLE (e.g. mypkg.model:predict), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as 'python -m' would: modules next to the user
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise CliError(f"no such file: {module_name}")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or loaded.loader is None:
                raise CliError(f"cannot import {module_name}")
            module = importlib.util.module_from_spec(loaded)
            # Registered first, as an import would: a dataclass under postponed
            # annotations looks its module up in sys.modules while it is created.
            sys.modules[loaded.name] = module
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except CliError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import-time failure of user code is one line
        raise CliError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise CliError(f"{spec} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def _check_plot_backend() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(NEEDS_MATPLOTLIB) from None


def run(args: argparse.Namespace) -> int:
    """Profile, print, and save or plot if asked.

    Args:
        args: The parsed command line.

    Returns:
        0.

    Raises:
        CliError: The target cannot be loaded, fails on a batch, or ``--plot``
            without matplotlib.
    """
    if args.plot is not None:
        _check_plot_backend()  # fail before the sweep, not after it
    if args.max_repeats < args.repeats:
        raise CliError(f"--max-repeats {args.max_repeats} is below --repeats {args.repeats}")
    fn = load_callable(args.target)
    show = sys.stderr.isatty()
    total = len(set(args.batch_sizes)) * (args.warmup + args.max_repeats)
    with Progress("profiling", total, enabled=show) as bar:
        try:
            result = profile(
                fn,
                args.input_shape,
                batch_sizes=args.batch_sizes,
                framework=args.framework,
                dtype=args.dtype,
                device=args.device,
                warmup=args.warmup,
                repeats=args.repeats,
                max_repeats=args.max_repeats,
                time_budget_s=args.budget_s,
                sla_ms=args.sla_ms,
                name=args.target,
                on_step=lambda done, total: bar.set(done * bar.total // total),
            )
        except RuntimeError as exc:  # the callable failed on a batch: say which, in one line
            raise CliError(str(exc)) from None
    print(format_profile(result))
    if args.json is not None:
        result.save(args.json)
        print(f"saved {args.json} (use: batchkit simulate --profile {args.json} --rate ...)")
    if args.plot is not None:
        plot(result, args.plot)
        print(f"plotted {args.plot}")
    return 0


def format_profile(result: ProfileResult) -> str:
    """The printed report: the table, the knee and how sure it is, and the advice (none
    when the timings leave the knee in doubt).

    Args:
        result: The profile to report.
    """
    shape = ", ".join(map(str, result.input_shape))
    lines = [
        f"{result.target}: input [B, {shape}] {result.dtype} ({result.framework}, "
        f"{result.device}); {result.repeats} timed runs per size, in turn, after "
        f"{result.warmup} warm-up; {_stopped(result)}",
        f"{'batch':>7}{'median ms':>11}{'95% CI ms':>17}{'p10-p90 ms':>17}{'items/s':>11}"
        f"{'of peak':>9}",
    ]
    peak = result.peak.throughput
    for p in result.points:
        mark = "  <- knee" if p.batch_size == result.knee else ""
        ci = _range(p.ci_low_ms, p.ci_high_ms)
        lines.append(
            f"{p.batch_size:>7}{p.latency_ms:>11.3f}{ci:>17}{_spread(p):>17}"
            f"{p.throughput:>11,.0f}{p.throughput / peak:>9.0%}{mark}"
        )
    fixed, per_item = result.fit()
    lines.append(
        f"knee: batch size {result.knee} (smallest within 5% of the peak "
        f"{peak:,.0f} items/s); robust fit: {fixed:.3f} ms + {per_item:.4f} ms x B"
    )
    if not result.knee_determined:
        low, high = result.knee_range
        lines.append(
            f"no recommendation: with each median anywhere in its 95% confidence interval,\n"
            f"  the knee could be any size from {low} to {high}: the timings are too noisy to "
            f"choose\n  (rerun with a larger --budget-s or --max-repeats, on a quieter machine)"
        )
        return "\n".join(lines)
    if result.repeats < 3:
        lines.append(f"  note: {result.repeats} run(s) per size say little; use 3 or more")
    rec = result.recommendation
    target = f"for a {rec.sla_ms:g} ms target" if rec.sla_ms is not None else "(no --sla-ms given)"
    lines.append(
        f"recommended {target}: max_batch_size={rec.max_batch_size}, "
        f"max_wait_ms={rec.max_wait_ms:g}"
    )
    lines.append(
        f"  {rec.reason}; worst case ~{rec.worst_latency_ms:.1f} ms, "
        f"capacity ~{rec.capacity:,.0f} req/s"
    )
    if not rec.meets_sla:
        lines.append(
            "  warning: the target cannot be met by batching; a faster model or device is needed"
        )
    return "\n".join(lines)


def _stopped(result: ProfileResult) -> str:
    """Why the rounds stopped."""
    took = f"{result.elapsed_s:.1f} s"
    if result.knee_determined:
        return f"the knee settled ({took})"
    if result.time_budget_s is not None and result.elapsed_s >= result.time_budget_s:
        return f"the {result.time_budget_s:g} s budget ran out before the knee settled"
    return f"{result.repeats} runs per size did not settle the knee ({took})"


def _range(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None else f"{low:.3f}-{high:.3f}"


def _spread(point: ProfilePoint) -> str:
    return _range(point.p10_ms, point.p90_ms)


def plot(result: ProfileResult, path: Path) -> None:
    """Latency and throughput against batch size, the knee marked.

    Args:
        result: The profile to plot.
        path: The image file to write (its suffix picks the format: ``.png``, ``.svg``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    sizes = [p.batch_size for p in result.points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [p.throughput for p in result.points], "o-", color="tab:blue")
    low, high = zip(*(p.throughput_range for p in result.points))
    ax.fill_between(sizes, low, high, color="tab:blue", alpha=0.2, label="p10-p90")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("items/s", color="tab:blue")
    ax.axvline(result.knee, color="grey", linestyle="--", label=f"knee ({result.knee})")
    ax.legend(loc="upper left")
    lat = ax.twinx()
    lat.plot(sizes, [p.latency_ms for p in result.points], "s-", color="tab:red")
    lat.set_ylabel("latency ms (median)", color="tab:red")
    ax.set_title(result.target)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
