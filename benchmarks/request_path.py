"""The functions and files one steady-state request passes through, counted.

Traces, with a profile hook on every thread, one request of each kind after a warm-up
call: `await f.acall(x)` of an async identity function and `f(x)` of a sync one, both
with default settings. Counts distinct batchkit functions (comprehensions, lambdas and
generator expressions left out), the files they live in, and how often the path moves
from one file to another. docs/architecture.md prints its output.

Run: python benchmarks/request_path.py [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import batchkit

PACKAGE = str(Path(batchkit.__file__).parent) + "/"
SKIPPED = ("<listcomp>", "<genexpr>", "<lambda>", "<dictcomp>", "<setcomp>")


class PathRecorder:
    """Records every batchkit function called while `recording` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.recording = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.recording or event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE) and not any(s in code.co_qualname for s in SKIPPED):
            self.calls.append((code.co_filename[len(PACKAGE) :], code.co_qualname))

    def summary(self) -> dict[str, Any]:
        calls, self.calls = self.calls, []
        moves = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
        return {
            "functions": len(set(calls)),
            "files": len({f for f, _ in calls}),
            "file_changes": moves,
            "path": sorted({f"{f}:{q}" for f, q in calls}),
        }


def trace() -> dict[str, dict[str, Any]]:
    """One steady-state `acall` and one `f(x)`, each traced."""
    recorder = PathRecorder()
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    out: dict[str, dict[str, Any]] = {}
    try:

        @batchkit.batched
        async def identity_async(xs: list[int]) -> list[int]:
            return list(xs)

        async def one_acall() -> None:
            await identity_async.acall(0)  # warm-up: binds the loop
            await asyncio.sleep(0.01)
            recorder.recording = True
            await identity_async.acall(1)
            await asyncio.sleep(0)
            recorder.recording = False
            out["acall"] = recorder.summary()
            await identity_async.aclose()

        asyncio.run(one_acall())

        @batchkit.batched
        def identity(xs: list[int]) -> list[int]:
            return list(xs)

        identity(0)  # warm-up: starts the worker
        time.sleep(0.05)
        recorder.recording = True
        identity(1)
        time.sleep(0.05)  # the worker's return to its wait is part of the path
        recorder.recording = False
        out["call"] = recorder.summary()
        identity.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    paths = trace()
    if args.json:
        print(json.dumps(paths))
        return
    for kind, label in (("acall", "await f.acall(x)"), ("call", "f(x)")):
        p = paths[kind]
        print(f"{label}: {p['functions']} functions in {p['files']} files, "
              f"{p['file_changes']} file changes")  # fmt: skip
        for entry in p["path"]:
            print(f"  {entry}")


if __name__ == "__main__":
    main()
