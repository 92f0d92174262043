"""One request's path through the serving core: counted, and kept from growing back."""

from __future__ import annotations

from tests.benchmarks._scripts import load_script

# What one steady-state request passes today (benchmarks/request_path.py); the issue's
# goal is 30 functions in 6 files. Lower these when the path shortens.
MOST_FUNCTIONS = {"acall": 29, "call": 30}
MOST_FILES = 13


def test_one_request_passes_no_more_functions_and_files_than_today() -> None:
    paths = load_script("request_path").trace()
    for kind, most in MOST_FUNCTIONS.items():
        assert paths[kind]["functions"] <= most, paths[kind]["path"]
        assert paths[kind]["files"] <= MOST_FILES, paths[kind]["path"]


def test_the_path_goes_through_the_parts_the_architecture_page_names() -> None:
    path = load_script("request_path").trace()["call"]["path"]
    files = {entry.split(":")[0] for entry in path}
    for part in ("serve/scheduler.py", "serve/threads.py", "serve/execute.py", "serve/request.py"):
        assert part in files
