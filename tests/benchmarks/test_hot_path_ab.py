"""benchmarks/hot_path_ab.py: each alternative it times admits the same way as the
choice kept; installing a choice back restores it."""

from __future__ import annotations

import batchkit
from batchkit.serve.core import ServingCore
from tests.benchmarks._scripts import load_script


def test_the_with_lock_alternative_admits_as_submit_does() -> None:
    bench = load_script("hot_path_ab")

    @batchkit.batched(max_batch_size=4, max_wait_ms=1000)
    def identity(xs: list[int]) -> list[int]:
        return xs

    core = identity.runtime.core
    kept, other = core.make_request(1, 0, None), core.make_request(2, 0, None)
    with core.lock:  # (no worker takes them meanwhile)
        core.submit(kept)
        bench._submit_with(core, other)
        assert list(core.lane.arrivals) == [kept, other]
        assert other.enqueued_at >= kept.enqueued_at > 0.0
    assert identity(3) == 3 and kept.wait(5) and other.wait(5)
    assert (kept.value, other.value) == (1, 2)
    identity.close()


def test_installing_the_kept_choices_restores_them() -> None:
    bench = load_script("hot_path_ab")
    kept_submit = ServingCore.submit
    for install, _ in bench.CHOICES.values():
        install(False)
        install(True)
    assert ServingCore.submit is kept_submit
