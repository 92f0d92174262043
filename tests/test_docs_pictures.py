"""The docs site's pictures and styling: every picture a page shows exists and is an SVG
with a size; the plots benchmarks/plots.py writes are committed and shown; its plotting
reads padding.py's table and draws every row it is given; code blocks wrap."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from tests._modules import load_module

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
SVG_NS = "{http://www.w3.org/2000/svg}"


def plots() -> ModuleType:
    """benchmarks/plots.py (matplotlib is imported only when a plot is drawn)."""
    return load_module(ROOT / "benchmarks" / "plots.py", "benchmark_plots")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def shown_images() -> dict[Path, list[str]]:
    """File each page shows (resolved against the page) -> the pages showing it."""
    shown: dict[Path, list[str]] = {}
    for page in pages():
        for target in IMAGE.findall(page.read_text()):
            path = (page.parent / target).resolve()
            shown.setdefault(path, []).append(str(page.relative_to(ROOT)))
    return shown


def test_every_picture_a_page_shows_exists() -> None:
    missing = [
        f"{p.relative_to(ROOT)} (shown by {', '.join(by)})"
        for p, by in shown_images().items()
        if not p.is_file()
    ]
    assert not missing, missing


def test_every_picture_in_docs_img_is_a_sized_svg_that_a_page_shows() -> None:
    shown = shown_images()
    files = sorted((DOCS / "img").glob("*"))
    assert files
    for path in files:
        assert path.suffix == ".svg", path
        root = ET.parse(path).getroot()
        assert root.tag == f"{SVG_NS}svg", path
        assert root.get("viewBox") or root.get("width"), f"{path.name} has no size"
        assert path.resolve() in shown, f"{path.name} is shown by no page"


def test_the_diagram_names_each_step_of_a_request() -> None:
    text = " ".join(
        t.text or "" for t in ET.parse(DOCS / "img" / "request-path.svg").iter(f"{SVG_NS}text")
    )
    for step in (
        "callers",
        "admission",
        "queue",
        "policy",
        "collate",
        "fn(batch)",
        "split",
        "answers",
    ):
        assert step in text, step


def test_each_plot_the_script_writes_is_committed_and_shown() -> None:
    shown = shown_images()
    for name in plots().FILES.values():
        path = DOCS / "img" / name
        assert path.is_file(), f"docs/img/{name}: run python benchmarks/plots.py"
        assert path.resolve() in shown, f"docs/img/{name} is shown by no page"


# The shape of benchmarks/padding.py's table (a header, rows, then a blank line).
PADDING_OUTPUT = """\
# padding waste, batch size 32: 3000 stdlib docstring paragraphs
grouping                                     waste  batches
random (shuffled)                           78.74%       94
batchkit SortedBatcher                       4.10%       94
batchkit BucketedBatcher pow2 [8, 16, 32]    3.81%       97

(random and HF rows: mean over 5 seeds)
PASS  SortedBatcher waste == global sort: 4.1034% vs 4.1034%
"""


def test_the_padding_table_is_read_row_by_row() -> None:
    rows = plots().padding_rows(PADDING_OUTPUT)
    assert list(rows) == [
        "random (shuffled)",
        "batchkit SortedBatcher",
        "batchkit BucketedBatcher pow2 [8, 16, 32]",
    ]
    assert rows["batchkit SortedBatcher"] == pytest.approx(0.041)


def test_output_without_a_padding_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no padding table"):
        plots().padding_rows("PASS  something\n")


def svg_texts(path: Path) -> str:
    return " ".join(t.text or "" for t in ET.parse(path).iter(f"{SVG_NS}text"))


def test_each_plot_draws_every_row_it_is_given(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[plot]"')
    module = plots()
    rows = module.padding_rows(PADDING_OUTPUT)
    module.plot_padding(rows, tmp_path / "padding.svg")
    text = svg_texts(tmp_path / "padding.svg")
    assert all(name in text for name in rows) and "78.7%" in text

    module.plot_continuous(
        {"static": 1000.0, "continuous": 2500.0, "ideal": 2800.0}, tmp_path / "continuous.svg"
    )
    text = svg_texts(tmp_path / "continuous.svg")
    assert "2,500" in text and "2.5x" in text

    curves = module.SloCurves(
        loads=(0.5, 1.0),
        goodput={"target": {"light": [0.5, 0.9]}, "minimal": {"light": [0.5, 0.1]}},
        p99_ms={"target": {"light": [40.0, 95.0]}, "minimal": {"light": [45.0, math.nan]}},
        bound={"light": [0.5, 0.97]},
        labels={"target": "batchkit max_latency_ms", "minimal": "minimal"},
        missing={"ray-serve": "not installed"},
        target_ms=100.0,
    )
    module.plot_slo(curves, tmp_path / "slo.svg")
    text = svg_texts(tmp_path / "slo.svg")
    for label in (
        "batchkit max_latency_ms",
        "minimal",
        "device bound",
        "target 100 ms",
        "ray-serve: not run (not installed)",
    ):
        assert label in text, label


def test_a_rerun_on_the_same_numbers_writes_the_same_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason='the plots need matplotlib: pip install -e ".[plot]"')
    module = plots()
    tps = {"static": 1000.0, "continuous": 2500.0, "ideal": 2800.0}
    module.plot_continuous(tps, tmp_path / "a.svg")
    module.plot_continuous(tps, tmp_path / "b.svg")
    assert (tmp_path / "a.svg").read_bytes() == (tmp_path / "b.svg").read_bytes()


def test_code_blocks_wrap_long_lines_instead_of_being_cut() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    listed = re.search(r"^extra_css:\n((?:\s+- .+\n)+)", config, re.M)
    assert listed, "mkdocs.yml lists no extra_css"
    sheets = [line.strip()[2:] for line in listed.group(1).splitlines()]
    css = "".join((DOCS / sheet).read_text() for sheet in sheets)
    rules = re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S))
    wrapping = [
        selector
        for selector, body in rules
        if re.search(r"pre\s*>\s*code", selector) and re.search(r"white-space:\s*pre-wrap", body)
    ]
    assert wrapping, f"no rule in {sheets} wraps pre > code"
