"""Regenerate, or check, every output of the ``batchkit`` command shown in the docs.

    python docs/outputs.py            # rewrite the seeded outputs in docs/*.md
    python docs/outputs.py --timed    # the timed ones too (demo, profile: a few seconds)
    python docs/outputs.py --check    # exit 1 naming every seeded block that is stale

A ``console`` block is generated when the line before its fence is a marker comment:

    <!-- outputs.py -->                       the output is exact (seeded simulations,
                                              memory arithmetic, errors): --check
                                              compares it character for character
    <!-- outputs.py keep=^(batcher|goodput) -->  only the output lines this regular
                                              expression matches are shown
    <!-- outputs.py timed -->                 an example run (demo, profile): its
                                              numbers change from run to run, so
                                              --check only runs the command briefly
                                              and compares the table's header line

Each ``$ `` line of the block (with ``\\`` continuation lines) is run by bash in a fresh
directory, in order, with ``batchkit`` meaning ``python -m batchkit`` of this checkout
and stderr shown with stdout (an error example shows its message). ``mlp.py``, the
model the profile examples load, is written there first. The commands are the docs'
own, so what a reader copies is what produced the text.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = re.compile(
    r"^<!-- outputs\.py(?P<options>.*?)-->\n```console\n(?P<body>.*?)```\n", re.M | re.S
)
# The two-layer numpy MLP that docs/cli.md profiles (W1 512x2048, W2 2048x512).
MLP = """\
import numpy as np

_rng = np.random.default_rng(0)
W1 = _rng.standard_normal((512, 2048)).astype(np.float32)
W2 = _rng.standard_normal((2048, 512)).astype(np.float32)


def predict(batch):
    return np.maximum(batch @ W1, 0) @ W2
"""
# What a timed command gets appended for --check: the shortest run that prints its table.
BRIEF = {
    "demo": ["--requests", "64"],
    "profile": ["--warmup", "0", "--repeats", "1", "--max-repeats", "1", "--budget-s", "0"],
}


@dataclass
class Block:
    """One generated console block: where it is, how it is made, what it shows."""

    page: Path
    start: int  # offsets of the fenced block's body in the page's text
    end: int
    keep: re.Pattern[str] | None
    timed: bool
    commands: list[str]  # each as written, continuation lines included
    outputs: list[str]  # each command's shown output, as text


def find_blocks(page: Path) -> list[Block]:
    """Every marked console block of a docs page.

    Args:
        page: A Markdown file.
    """
    text = page.read_text()
    blocks = []
    for match in MARKER.finditer(text):
        options = match.group("options").strip()
        keep = re.search(r"keep=(\S+)", options)
        commands, outputs = _split(match.group("body"))
        blocks.append(
            Block(
                page=page,
                start=match.start("body"),
                end=match.end("body"),
                keep=re.compile(keep.group(1)) if keep else None,
                timed="timed" in options.split(),
                commands=commands,
                outputs=outputs,
            )
        )
    return blocks


def _split(body: str) -> tuple[list[str], list[str]]:
    """A block's commands (``$`` lines with their continuations) and each one's output."""
    commands: list[str] = []
    outputs: list[list[str]] = []
    continued = False
    for line in body.splitlines():
        if continued or line.startswith("$ "):
            if continued:
                commands[-1] += "\n" + line
            else:
                commands.append(line[2:])
                outputs.append([])
            continued = line.endswith("\\")
        elif outputs:
            outputs[-1].append(line)
    return commands, ["\n".join(lines) for lines in outputs]


def run_commands(commands: list[str], workdir: Path) -> list[str]:
    """Each command's output (stdout and stderr together), run one after another by
    one bash in ``workdir``, so a command sees the files and the ``$?`` of the last.

    Args:
        commands: Shell commands, as the docs show them.
        workdir: Where they run (``mlp.py`` is written there first).
    """
    (workdir / "mlp.py").write_text(MLP)
    mark = "@@outputs.py@@"
    script = [f"batchkit() {{ {shlex.quote(sys.executable)} -m batchkit \"$@\"; }}"]
    for command in commands:
        # The status survives the marker's echo, for an `echo $?` that follows.
        script.append(f"__status=$?; echo {mark}; (exit $__status)")
        script.append(command)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "80",  # argparse wraps usage lines to the terminal's width
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    parts = done.stdout.split(mark + "\n")[1:]
    return [part.rstrip("\n") for part in parts]


def render(block: Block, outputs: list[str]) -> str:
    """The block's body with these outputs (filtered by its ``keep``)."""
    lines = []
    for command, output in zip(block.commands, outputs):
        lines.append(f"$ {command}")
        shown = output.splitlines()
        if block.keep is not None:
            shown = [line for line in shown if block.keep.search(line)]
        lines.extend(shown)
    return "\n".join(lines) + "\n"


def header_line(output: str) -> str | None:
    """A timed table's column-header line (the second line of the output), or None."""
    lines = output.splitlines()
    return lines[1] if len(lines) > 1 else None


def stale_timed(block: Block, workdir: Path) -> list[str]:
    """What a timed block shows that the command no longer prints: each command, run
    briefly, must print the header line shown."""
    brief = []
    for command in block.commands:
        words = shlex.split(command.replace("\\\n", " "))
        name = words[words.index("batchkit") + 1] if "batchkit" in words[:-1] else ""
        brief.append(" ".join([command.replace("\\\n", " "), *BRIEF.get(name, [])]))
    problems = []
    for command, shown, fresh in zip(block.commands, block.outputs, run_commands(brief, workdir)):
        if header_line(shown) != header_line(fresh):
            problems.append(
                f"{command!r}: shown header {header_line(shown)!r}, now {header_line(fresh)!r}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Rewrite or check the docs' command outputs.

    Args:
        argv: The command-line arguments (``--check``, ``--timed``).

    Returns:
        0, or 1 when ``--check`` found a stale block.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--timed", action="store_true", help="also regenerate timed blocks")
    args = parser.parse_args(argv)
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        new_text = text
        # From the last block back, so the earlier blocks' offsets stay right.
        for block in reversed(find_blocks(page)):
            with tempfile.TemporaryDirectory() as tmp:
                if args.check and block.timed:
                    stale += [f"{page.name}: {p}" for p in stale_timed(block, Path(tmp))]
                    continue
                if block.timed and not args.timed:
                    continue
                body = render(block, run_commands(block.commands, Path(tmp)))
            if body != text[block.start : block.end]:
                stale.append(f"{page.name}: the block of {block.commands[0].splitlines()[0]!r}")
                new_text = new_text[: block.start] + body + new_text[block.end :]
        if not args.check and new_text != text:
            page.write_text(new_text)
            print(f"rewrote {page.relative_to(ROOT)}")
    if args.check and stale:
        print("stale outputs (regenerate with: python docs/outputs.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
