"""benchmarks/hot_path_ab.py: each alternative it times makes the same request, or
admits the same way, as the choice kept; installing a choice back restores it."""

from __future__ import annotations

import asyncio

from batchkit.serve import callers
from batchkit.serve.core import ServingCore
from batchkit.serve.request import Request, new_request
from tests.benchmarks._scripts import load_script


def fields(req: Request) -> dict[str, object]:
    values = {name: getattr(req, name, None) for name in Request.__slots__}
    values.pop("future")  # a fresh future each: compared by kind below
    return values


def test_the_class_call_alternative_makes_the_request_new_request_makes() -> None:
    bench = load_script("hot_path_ab")
    loop = asyncio.new_event_loop()
    try:
        kept = new_request("x", 0.0, None, 0, loop, None, 1.5)
        other = bench._SlowRequest("x", 0.0, None, 0, loop, None, 1.5)
        assert fields(other) == fields(kept)
        assert type(other.future) is type(kept.future)
    finally:
        loop.close()


def test_installing_the_kept_choices_restores_them() -> None:
    bench = load_script("hot_path_ab")
    kept_submit = ServingCore.submit
    for install, _ in bench.CHOICES.values():
        install(False)
        install(True)
    assert callers.new_request is new_request
    assert ServingCore.submit is kept_submit


def test_a_short_control_run_gives_one_ratio_per_pair() -> None:
    bench = load_script("hot_path_ab")
    ratios = asyncio.run(bench.pairs("control", 2))
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
