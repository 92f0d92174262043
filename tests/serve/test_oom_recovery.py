"""Out-of-memory recovery releases what the failed attempt held before it retries, then
runs the ``on_oom`` hook: weak references to objects the failing call created must be
dead by then (on a GPU those are the activations the retry needs room for)."""

from __future__ import annotations

import asyncio
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import batchkit


class Activation:
    """Stands for a tensor the forward pass allocates."""


def _dead(refs: list[weakref.ref[Any]]) -> bool:
    return all(ref() is None for ref in refs)


class Recorder:
    """A model that allocates per item and runs out of memory above ``fits`` items; the
    on_oom hook notes whether everything the failed calls created is already gone."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.created: list[weakref.ref[Any]] = []
        self.events: list[str] = []
        self.released_at_hook: list[bool] = []

    def forward(self, xs: list[int]) -> list[int]:
        activations = [Activation() for _ in xs]
        self.created += [weakref.ref(a) for a in activations]
        self.events.append(f"call {len(xs)}")
        if len(xs) > self.fits:
            raise MemoryError(f"{len(xs)} items do not fit")
        return [x * 2 for x in xs]

    def on_oom(self) -> None:
        self.events.append("on_oom")
        self.released_at_hook.append(_dead(self.created))


def test_a_sync_batch_that_runs_out_of_memory_is_released_before_the_hook_and_the_retry() -> None:
    model = Recorder(fits=2)
    f = batchkit.batched(max_batch_size=8, max_wait_ms=1000, on_oom=model.on_oom)(model.forward)
    assert f.map(range(8)) == [x * 2 for x in range(8)]
    f.close()
    assert model.released_at_hook and all(model.released_at_hook)
    # Each failure is followed by its hook, then by the retry of its first half.
    assert model.events[:4] == ["call 8", "on_oom", "call 4", "on_oom"]
    assert f.stats().effective_max_batch_size == {"default": 2}


def test_an_async_batch_that_runs_out_of_memory_is_released_before_the_hook() -> None:
    model = Recorder(fits=2)

    @batchkit.batched(max_batch_size=8, max_wait_ms=1000, on_oom=model.on_oom)
    async def forward(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)
        return model.forward(xs)

    async def main() -> list[int]:
        out = await forward.amap(range(8))
        await forward.aclose()
        return out

    assert asyncio.run(main()) == [x * 2 for x in range(8)]
    assert model.released_at_hook and all(model.released_at_hook)
    assert model.events[:2] == ["call 8", "on_oom"]


def test_the_failed_attempts_collated_argument_is_released_before_the_hook() -> None:
    batches: list[weakref.ref[Any]] = []
    at_hook: list[bool] = []

    class Collated(list[int]):
        pass

    def collate(items: list[int]) -> Collated:
        batch = Collated(items)
        batches.append(weakref.ref(batch))
        return batch

    def forward(xs: Collated) -> list[int]:
        if len(xs) > 1:
            raise MemoryError
        return list(xs)

    def on_oom() -> None:
        at_hook.append(_dead(batches))

    f = batchkit.batched(max_batch_size=4, max_wait_ms=1000, collate=collate, on_oom=on_oom)(
        forward
    )
    assert f.map([1, 2, 3, 4]) == [1, 2, 3, 4]
    f.close()
    assert at_hook and all(at_hook)


def test_isolating_a_poison_item_releases_each_failed_part_before_the_next_call() -> None:
    created: list[weakref.ref[Any]] = []
    alive_at_call: list[bool] = []

    def forward(xs: list[int]) -> list[int]:
        alive_at_call.append(not _dead(created))
        activation = Activation()
        created.append(weakref.ref(activation))
        if 3 in xs:
            raise ValueError("poison")
        return xs

    f = batchkit.batched(max_batch_size=8, max_wait_ms=1000, isolate_errors=True)(forward)
    with pytest.raises(ValueError, match="poison"):
        f.map(range(8))
    f.close()
    assert len(alive_at_call) > 2 and not any(alive_at_call)


def test_a_malformed_item_releases_what_the_failed_collate_made_before_the_retry() -> None:
    made: list[weakref.ref[Any]] = []
    alive_at_collate: list[bool] = []

    def collate(items: list[str]) -> list[str]:
        alive_at_collate.append(not _dead(made))
        scratch = Activation()
        made.append(weakref.ref(scratch))
        if "bad" in items:
            raise ValueError("malformed item")
        return items

    f = batchkit.batched(max_batch_size=4, max_wait_ms=1000, collate=collate)(lambda xs: xs)
    with pytest.raises(ValueError, match="malformed"):
        f.map(["a", "bad", "c", "d"])
    f.close()
    assert len(alive_at_collate) > 1 and not any(alive_at_collate)


def test_an_out_of_memory_error_a_caller_keeps_holds_no_frame_locals() -> None:
    created: list[weakref.ref[Any]] = []

    def forward(xs: list[int]) -> list[int]:
        activation = Activation()
        created.append(weakref.ref(activation))
        raise MemoryError("does not fit even alone")

    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, on_oom=False)(forward)
    with pytest.raises(MemoryError) as info:
        f(1)
    f.close()
    assert info.value.__traceback__ is not None  # still printable for the caller
    assert _dead(created)


def test_on_oom_false_runs_no_hook_and_the_default_empties_the_cuda_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emptied: list[bool] = []

    class FakeCuda:
        OutOfMemoryError = MemoryError

        @staticmethod
        def is_initialized() -> bool:
            return True

        @staticmethod
        def empty_cache() -> None:
            emptied.append(True)

    class FakeTorch:
        cuda = FakeCuda

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)

    def forward(xs: list[int]) -> list[int]:
        if len(xs) > 1:
            raise MemoryError
        return xs

    for on_oom, expect in ((None, True), (False, False)):
        emptied.clear()
        f = batchkit.batched(max_batch_size=2, max_wait_ms=1000, on_oom=on_oom)(forward)
        assert f.map([1, 2]) == [1, 2]
        f.close()
        assert bool(emptied) is expect, on_oom


def test_the_default_hook_does_nothing_while_cuda_is_not_initialised() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already initialised in this process")
    batchkit.serve.options.empty_cuda_cache()
    assert not torch.cuda.is_initialized()  # it never initialises CUDA itself


def test_a_failing_on_oom_hook_is_logged_and_the_retry_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def hook() -> None:
        raise RuntimeError("hook broke")

    model = Recorder(fits=1)
    f = batchkit.batched(max_batch_size=2, max_wait_ms=1000, on_oom=hook)(model.forward)
    with caplog.at_level(logging.ERROR, logger="batchkit"):
        assert f.map([1, 2]) == [2, 4]
    f.close()
    assert "on_oom hook" in caplog.text


@pytest.mark.parametrize("bad", [1, "empty", object()])
def test_on_oom_must_be_callable_none_or_false(bad: Callable[[], None]) -> None:
    with pytest.raises(TypeError, match="on_oom must be callable"):
        batchkit.batched(on_oom=bad)
