"""The docs' plots, drawn from runs of the benchmark scripts themselves.

Writes three SVG files (into ``docs/img/`` unless ``--out`` says otherwise; needs
matplotlib, ``pip install -e ".[plot]"``):

- ``slo-goodput.svg``: goodput and served p99 latency against offered load, for
  batchkit (with and without a latency target, with a queue bound) and each peer
  that is installed, in the light and the heavy phase, with the device's own bound
  measured in the same run: ``slo.run`` (``benchmarks/slo.py``'s load points, each
  system on the same seeded arrivals);
- ``padding-waste.svg``: padded slots per grouping policy on the stdlib docstring
  corpus, as ``benchmarks/padding.py`` prints them (run as a script: it has no
  function that returns its rows);
- ``continuous-throughput.svg``: output tokens per second of ``ContinuousBatcher``,
  static request-level batching and the zero-overhead ideal scheduler on one
  emulated accelerator: ``benchmarks/continuous.py``'s runners, on its workload.

It prints what it plotted, with the ratios against the peers and the bounds.

Usage::

    python benchmarks/plots.py                 # ~5 min on 2 cores; what docs/img holds
    python benchmarks/plots.py --quick         # ~1.5 min: shorter segments, noisier
    python benchmarks/plots.py --only padding,continuous --out /tmp/img
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DOCS_IMG = HERE.parent / "docs" / "img"
# Each plot's name (for --only) and the file it writes.
FILES = {
    "slo": "slo-goodput.svg",
    "padding": "padding-waste.svg",
    "continuous": "continuous-throughput.svg",
}
PLOTS = tuple(FILES)

# One colour per row, the same in every figure: batchkit's rows in blues, peers apart.
COLOURS = {
    "target": "#0d47a1",
    "fixed": "#42a5f5",
    "queue-bound": "#26a69a",
    "ray-serve": "#e65100",
    "mixedbread": "#8e24aa",
    "minimal": "#757575",
}
BOUND_COLOUR = "#000000"


def pyplot() -> Any:
    """matplotlib's pyplot, set up for SVG the docs can diff: text kept as text, no
    date, fixed element ids (a rerun on the same numbers writes the same file)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit('plots need matplotlib: pip install -e ".[plot]"') from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "batchkit",
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` as SVG without the date matplotlib stamps by default."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {path}")


# --------------------------------------------------------------------------- goodput


@dataclass(frozen=True)
class SloCurves:
    """What ``slo-goodput.svg`` shows, per phase (``"light"``, ``"heavy"``).

    Attributes:
        loads: Offered loads, as fractions of the phase's capacity.
        goodput: Row name -> phase -> in-time answers/s over capacity, per load.
        p99_ms: Row name -> phase -> served p99 latency in ms, per load (NaN: none served).
        bound: Phase -> the device's goodput bound measured in the same run, per load.
        labels: Row name -> its label in ``slo.py``'s table.
        missing: Row label -> why it did not run here.
        target_ms: The latency target.
    """

    loads: tuple[float, ...]
    goodput: dict[str, dict[str, list[float]]]
    p99_ms: dict[str, dict[str, list[float]]]
    bound: dict[str, list[float]]
    labels: dict[str, str]
    missing: dict[str, str]
    target_ms: float


def slo_curves(quick: bool) -> SloCurves:
    """Run ``benchmarks/slo.py``'s load points (its shift stream: light, then heavy)."""
    import slo

    loads = slo.LOADS if quick else (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
    config = slo.Config(loads=loads, streams=("shift",))
    if quick:  # slo.py's own quick segments
        config = replace(config, warm_s=0.2, segment_s=0.8, grace_s=0.15)
    res = asyncio.run(slo.run(config))
    phases = ("light", "heavy")
    ran = [name for name in config.systems if name in res.cells]

    def curve(name: str, phase: str, field: str) -> list[float]:
        return [slo.median_of(res, name, slo.column(phase, x), field) for x in loads]

    return SloCurves(
        loads=tuple(loads),
        goodput={n: {p: curve(n, p, "goodput") for p in phases} for n in ran},
        p99_ms={n: {p: curve(n, p, "p99_ms") for p in phases} for n in ran},
        bound={p: [slo.bound_goodput(res, config, p, x) for x in loads] for p in phases},
        labels={n: slo.SYSTEMS[n] for n in ran},
        missing={slo.SYSTEMS[n]: why for n, why in res.missing.items()},
        target_ms=slo.TARGET_S * 1e3,
    )


def plot_slo(curves: SloCurves, path: Path) -> None:
    """Goodput (top) and served p99 (bottom) against offered load, light and heavy."""
    plt = pyplot()
    phases = list(curves.bound)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(
        2, len(phases), figsize=(10, 7), sharex=True, sharey="row", squeeze=False
    )
    for col, phase in enumerate(phases):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(
            curves.loads,
            curves.bound[phase],
            color=BOUND_COLOUR,
            linestyle=":",
            label="device bound (same run)",
        )
        for name, label in curves.labels.items():
            colour = COLOURS.get(name)
            top.plot(
                curves.loads, curves.goodput[name][phase], marker="o", color=colour, label=label
            )
            bottom.plot(
                curves.loads, curves.p99_ms[name][phase], marker="o", color=colour, label=label
            )
        bottom.axhline(
            curves.target_ms,
            color="#c62828",
            linestyle="--",
            label=f"target {curves.target_ms:g} ms",
        )
        top.set_title(f"{phase} phase")
        top.set_ylabel("goodput (in-time answers/s / capacity)")
        top.set_ylim(bottom=0)
        bottom.set_yscale("log")  # from tens of ms in time to seconds late
        bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        bottom.yaxis.set_minor_formatter(NullFormatter())
        bottom.set_ylabel("served p99 latency (ms)")
        bottom.set_xlabel("offered load (x capacity)")
    handles, labels = axes[1][0].get_legend_handles_labels()
    bound_handle = axes[0][0].get_lines()[0]
    fig.legend(
        [bound_handle, *handles],
        [bound_handle.get_label(), *labels],
        loc="lower center",
        ncol=4,
        frameon=False,
        bbox_to_anchor=(0.5, -0.06),
    )
    note = "; ".join(f"{label}: not run ({why})" for label, why in curves.missing.items())
    fig.suptitle(
        "Goodput under overload: answers within the target, per second "
        "(benchmarks/slo.py)" + (f"\n{note}" if note else ""),
        fontsize=11,
    )
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


def print_slo(curves: SloCurves) -> None:
    """Each row's goodput over the device bound, and batchkit's target row over the
    best other row, per phase and load."""
    print("\n# goodput / device bound (same run), per offered load")
    head = "  ".join(f"{x:>6g}x" for x in curves.loads)
    for phase in curves.bound:
        print(f"\n{phase:<26}{head}")
        for name, label in curves.labels.items():
            ratios = [
                g / b if b > 0 else math.nan
                for g, b in zip(curves.goodput[name][phase], curves.bound[phase])
            ]
            print(f"{label:<26}" + "  ".join(f"{r:>7.2f}" for r in ratios))
        if "target" in curves.goodput:
            others = [n for n in curves.goodput if n != "target"]
            best = [
                max((curves.goodput[n][phase][i] for n in others), default=math.nan)
                for i in range(len(curves.loads))
            ]
            mine = curves.goodput["target"][phase]
            print(
                f"{'target / best other row':<26}"
                + "  ".join(f"{m / b if b > 0 else math.nan:>7.2f}" for m, b in zip(mine, best))
            )
    for label, why in curves.missing.items():
        print(f"(not run: {label}: {why})")


# --------------------------------------------------------------------------- padding


# A row of padding.py's table: the grouping, its waste in percent, its batch count.
PADDING_ROW = re.compile(r"^(?P<name>\S.*?\S)\s+(?P<waste>\d+(?:\.\d+)?)%\s+(?P<batches>\d+)$")


def padding_rows(output: str) -> dict[str, float]:
    """Grouping -> padding waste (a fraction), read from ``padding.py``'s printed table.

    Raises:
        ValueError: The output holds no such table (the script's format changed).
    """
    rows: dict[str, float] = {}
    in_table = False
    for line in output.splitlines():
        if line.startswith("grouping"):
            in_table = True
            continue
        if in_table:
            match = PADDING_ROW.match(line.rstrip())
            if not match:
                break
            rows[match["name"]] = float(match["waste"]) / 100
    if not rows:
        raise ValueError("no padding table (a 'grouping  waste  batches' header) in the output")
    return rows


def run_padding(quick: bool) -> dict[str, float]:
    """Run ``benchmarks/padding.py`` and read its table; its PASS/MISS lines are shown."""
    command = [sys.executable, str(HERE / "padding.py"), *(["--quick"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(("PASS", "MISS", "#")):
            print(f"padding.py: {line}")
    if done.returncode not in (0, 1):  # 1: a MISS line, the table is still whole
        raise SystemExit(f"padding.py failed ({done.returncode}):\n{done.stderr}")
    return padding_rows(done.stdout)


def plot_padding(rows: dict[str, float], path: Path) -> None:
    """Padding waste per grouping, a horizontal bar each, batchkit's in blue."""
    plt = pyplot()
    names = list(rows)[::-1]  # the table's order, top to bottom
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    colours = [COLOURS["target"] if n.startswith("batchkit") else "#9e9e9e" for n in names]
    bars = ax.barh(names, [rows[n] * 100 for n in names], color=colours)
    ax.bar_label(bars, labels=[f"{rows[n]:.1%}" for n in names], padding=3, fontsize=9)
    ax.set_xlabel("padded slots / all slots (%), batch size 32")
    ax.set_title(
        "Padding waste by grouping policy (benchmarks/padding.py, MiniLM tokens "
        "of stdlib docstrings)",
        fontsize=10,
    )
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


# --------------------------------------------------------------------------- continuous


def continuous_tokens_per_s(quick: bool) -> dict[str, float]:
    """System -> output tokens/s on ``continuous.py``'s workload (medians of repeats,
    the continuous and static runs interleaved as that script does)."""
    import continuous

    n, repeats = (128, 1) if quick else (384, 3)
    prompts, outs = continuous.workload(n, seed=0)
    acc = continuous.Accelerator()
    runs: dict[str, list[float]] = {"continuous": [], "static": []}
    runners: dict[str, Callable[..., Any]] = {
        "continuous": continuous.run_continuous,
        "static": continuous.run_static,
    }
    for r in range(repeats):
        order = ["continuous", "static"] if r % 2 == 0 else ["static", "continuous"]
        for name in order:
            runs[name].append(runners[name](prompts, outs, acc).tps)
    out = {name: statistics.median(v) for name, v in runs.items()}
    out["ideal"] = continuous.simulate_ideal(prompts, outs).tps
    return out


def plot_continuous(tps: dict[str, float], path: Path) -> None:
    """Tokens/s bars: static, continuous, and the ideal scheduler's bound."""
    plt = pyplot()
    names = ["static", "continuous", "ideal"]
    labels = [
        "static batching\n(groups of 32)",
        "ContinuousBatcher\n(paged KV)",
        "ideal scheduler\n(zero overhead, bound)",
    ]
    colours = ["#9e9e9e", COLOURS["target"], "#ffffff"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(labels, [tps[n] for n in names], color=colours, edgecolor="#000000")
    ax.bar_label(bars, labels=[f"{tps[n]:,.0f}" for n in names], padding=3, fontsize=9)
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"Continuous vs static batching: {tps['continuous'] / tps['static']:.1f}x "
        f"(benchmarks/continuous.py)",
        fontsize=10,
    )
    ax.grid(axis="x", visible=False)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def chosen(value: str, parser: argparse.ArgumentParser) -> list[str]:
    """The plots named in ``--only`` (comma-separated), in the order of ``PLOTS``."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in PLOTS]
    if unknown or not names:
        parser.error(f"--only takes some of {', '.join(PLOTS)}; got {value!r}")
    return [p for p in PLOTS if p in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (~1.5 min), noisier")
    parser.add_argument("--only", default=",".join(PLOTS), help=f"some of {', '.join(PLOTS)}")
    parser.add_argument("--out", type=Path, default=DOCS_IMG, help="folder for the SVG files")
    args = parser.parse_args(argv)
    plots = chosen(args.only, parser)
    pyplot()  # fail now, not after minutes of running, when matplotlib is missing
    t0 = time.perf_counter()
    if "slo" in plots:
        curves = slo_curves(args.quick)
        print_slo(curves)
        plot_slo(curves, args.out / FILES["slo"])
    if "padding" in plots:
        rows = run_padding(args.quick)
        print(
            f"\npadding waste: SortedBatcher {rows.get('batchkit SortedBatcher', math.nan):.2%}"
            f", random {rows.get('random (shuffled)', math.nan):.2%}"
        )
        plot_padding(rows, args.out / FILES["padding"])
    if "continuous" in plots:
        tps = continuous_tokens_per_s(args.quick)
        print(
            f"\ntokens/s: continuous {tps['continuous']:,.0f}, static {tps['static']:,.0f}, "
            f"ideal {tps['ideal']:,.0f}; continuous / static = "
            f"{tps['continuous'] / tps['static']:.2f}x, continuous / ideal = "
            f"{tps['continuous'] / tps['ideal']:.1%}"
        )
        plot_continuous(tps, args.out / FILES["continuous"])
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
