"""Compare two git revisions of batchkit on the online workloads, interleaved in one run.

Each revision is checked out into its own temporary worktree; every repeat runs
``benchmarks/online.py`` (the copy in *this* checkout, so both revisions see the same
workloads) once per revision, in alternating order, as a fresh process with
``PYTHONPATH`` pointing at that revision. The report gives, per metric, each
revision's median over the repeats and the ratio of medians B / A with the spread of
the per-repeat ratios, then checks B against the machine's own limits measured in the
same processes (the minimal asyncio batcher, the floor row, the accelerator called
back to back with no batcher, the full-batch time T).

Usage::

    python benchmarks/compare.py main HEAD               # ~6 min on 2 cores
    python benchmarks/compare.py main HEAD --repeats 3   # quicker, noisier
    python benchmarks/compare.py HEAD~1 HEAD --only overhead

Use it for every change to the per-request path. On a shared VM, where two processes
running the same code differ by 10-30%, ``compare_inprocess.py`` judges the overhead
rows to a few percent: it runs both revisions in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from _report import check, med

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEMS = "batchkit,batchkit-sync,minimal"

# (label, scenario, system, higher is better)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("overhead async (req/s)", "overhead", "batchkit", True),
    ("overhead sync (req/s)", "overhead", "batchkit-sync", True),
    ("efficiency async", "efficiency", "batchkit", True),
    ("efficiency sync", "efficiency", "batchkit-sync", True),
    ("p99 async (T)", "p99", "batchkit", False),
    ("p99 sync (T)", "p99", "batchkit-sync", False),
    ("threads sync (req/s)", "threads", "batchkit-sync", True),
)
TOLERANCE = 0.03  # B may be this much worse than A on any metric


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into``."""
    path = into / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
        check=True,
        capture_output=True,
    )
    return path


def remove(trees: Iterable[Path]) -> None:
    """Remove worktrees made by `checkout`."""
    for tree in trees:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            capture_output=True,
        )


def one_run(tree: Path, only: str, quick: bool) -> dict[str, Any]:
    """One repeat of online.py against the batchkit in ``tree``: scenario -> system -> value."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        target = out.name
    cmd = [sys.executable, str(HERE / "online.py"), "--repeats", "1", "--only", only]
    cmd += ["--systems", SYSTEMS, "--json", target] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: some PASS/MISS line said MISS; the data is there
        raise RuntimeError(f"online.py failed for {tree}:\n{done.stdout}\n{done.stderr}")
    raw = json.loads(Path(target).read_text())
    os.unlink(target)
    values: dict[str, Any] = {}
    for scenario, rows in (raw["async"] or {}).items():
        values[scenario] = {name: xs[0] for name, xs in rows.items() if xs}
    if raw["threads"]:
        values["threads"] = {name: xs[0] for name, xs in raw["threads"].items() if xs}
    return values


def iqr(xs: list[float]) -> str:
    if len(xs) < 2:
        return ""
    q = statistics.quantiles(xs, n=4)
    return f"[{q[0]:.3f}-{q[2]:.3f}]"


def report(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> bool:
    def series(rev: str, scenario: str, system: str) -> list[float]:
        return [r[scenario][system] for r in runs[rev] if system in r.get(scenario, {})]

    print(f"\n{'metric':<24} {a:>12} {b:>12} {'B / A':>8} {'per-repeat B / A':>18}")
    ok = True
    for label, scenario, system, higher in METRICS:
        xa, xb = series(a, scenario, system), series(b, scenario, system)
        if not xa or not xb:
            continue
        ratio = med(xb) / med(xa)
        pairs = [y / x for x, y in zip(xa, xb)]
        print(f"{label:<24} {med(xa):>12.3f} {med(xb):>12.3f} {ratio:>8.3f} {iqr(pairs):>18}")
        worse = ratio < 1 - TOLERANCE if higher else ratio > 1 + TOLERANCE
        ok &= check(f"{label}: B within {TOLERANCE:.0%} of A", not worse, f"{ratio:.3f}")
    print(f"\nagainst this machine's limits, revision {b}, same processes:")
    bounds = (
        ("overhead", "batchkit", "minimal", 1.0, "the minimal batcher"),
        ("overhead", "batchkit", "floor (ref)", 0.9, "the floor row"),
        ("overhead", "batchkit-sync", "minimal", 1.0, "the minimal batcher"),
        ("efficiency", "batchkit", "direct (ref)", 0.98, "back-to-back calls via run_in_executor"),
        ("efficiency", "batchkit-sync", "direct-sync (ref)", 0.98, "back-to-back direct calls"),
    )
    for scenario, system, ref, target, what in bounds:
        xs, refs = series(b, scenario, system), series(b, scenario, ref)
        if xs and refs:
            r = med(xs) / med(refs)
            ok &= check(f"{scenario} {system} >= {target}x {what}", r >= target, f"{r:.3f}x")
    for system in ("batchkit", "batchkit-sync"):
        xs = series(b, "p99", system)
        if xs:
            ok &= check(f"p99 {system} <= 1.5 T", med(xs) <= 1.5, f"{med(xs):.2f} T")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a", help="the baseline revision (e.g. main)")
    p.add_argument("rev_b", help="the candidate revision (e.g. HEAD)")
    p.add_argument("--repeats", type=int, default=5, help="runs per revision (default 5)")
    p.add_argument("--only", default="overhead,efficiency,latency,threads")
    p.add_argument("--quick", action="store_true", help="smaller workloads per run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchkit-compare-") as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in (args.rev_a, args.rev_b)}
        try:
            runs: dict[str, list[dict[str, Any]]] = {rev: [] for rev in trees}
            order = [args.rev_a, args.rev_b]
            for r in range(args.repeats):
                for rev in order if r % 2 == 0 else order[::-1]:
                    runs[rev].append(one_run(trees[rev], args.only, args.quick))
                print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
        finally:
            remove(trees.values())
    print(
        f"# {args.rev_a} (A) against {args.rev_b} (B): {args.repeats} interleaved repeats of "
        "benchmarks/online.py each, medians"
    )
    return 0 if report(runs, args.rev_a, args.rev_b) else 1


if __name__ == "__main__":
    sys.exit(main())
