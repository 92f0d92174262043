"""Every example runs and exits 0, and the README's snippets run as written."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EXAMPLE_LIMIT_S = 300  # the longest (embed_minilm.py, timed three ways) takes ~2 min here


@pytest.mark.slow
@pytest.mark.timeout(EXAMPLE_LIMIT_S + 10)  # (the suite's default is 120 s a test)
@pytest.mark.parametrize(
    "script",
    # Examples that start a local Ray carry the ray marker (pytest -m ray selects them).
    [pytest.param(p, marks=pytest.mark.ray) if p.name.startswith("ray_") else p for p in EXAMPLES],
    ids=lambda p: p.name,
)
def test_example_runs(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=EXAMPLE_LIMIT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_readme_snippets_run() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_docs_home_page_lists_every_example() -> None:
    home = (ROOT / "docs" / "index.md").read_text()
    examples = [f"examples/{p.name}" for p in EXAMPLES]
    folders = [p for p in (ROOT / "examples").iterdir() if p.is_dir() and p.name[0] not in "_."]
    examples += [f"examples/{p.name}/" for p in folders]
    missing = [name for name in examples if f"`{name}`" not in home]
    assert not missing, f"docs/index.md does not list {missing}"


DOCS = sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_doc_snippets_run(page: Path) -> None:
    """Each page's python blocks run in order in one namespace (a later block may use an
    earlier one's names); a block that starts with ``# not run`` is illustration only. A
    page without a runnable block is skipped, not counted as a pass."""
    # Fences may be indented (inside a list item): their code is dedented.
    blocks = [
        textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    ]
    runnable = [b for b in blocks if not b.startswith("# not run")]
    if not runnable:
        pytest.skip(f"{page.relative_to(ROOT)} has no runnable python block")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in runnable:
        exec(compile(block, str(page), "exec"), namespace)
