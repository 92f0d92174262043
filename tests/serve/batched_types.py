"""What a type checker infers for the callers of `@batched` functions.

Never run: `test_batched_types.py` type-checks it with mypy. A line that ends in
`# error: CODE` must give exactly that error; every other line must give none (an
`assert_type` that does not hold is an error too).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from typing import Any

from typing_extensions import assert_type

from batchkit.serve.batched import BatchedFunction, batched


@batched
def lengths(texts: list[str]) -> list[int]:
    return [len(t) for t in texts]


def a_sync_function() -> None:
    assert_type(lengths, BatchedFunction[str, int])
    assert_type(lengths("a"), int)
    assert_type(lengths.map(["a", "b"]), list[int])
    lengths(["a", "b"])  # error: arg-type
    lengths(1)  # error: arg-type
    lengths.map([1, 2])  # error: list-item


async def a_sync_function_from_asyncio() -> None:
    assert_type(await lengths.acall("a"), int)
    assert_type(await lengths.amap(["a", "b"]), list[int])
    await lengths.acall(["a"])  # error: arg-type


@batched(max_batch_size=8, max_wait_ms=1.0)
async def alengths(texts: list[str]) -> list[int]:
    return [len(t) for t in texts]


async def an_async_function() -> None:
    assert_type(alengths, BatchedFunction[str, int, Coroutine[Any, Any, int]])
    assert_type(await alengths("a"), int)
    assert_type(await alengths.acall("a"), int)
    assert_type(await alengths.amap(["a"]), list[int])
    await alengths(["a"])  # error: arg-type


class Encoder:
    @batched
    def encode(self, texts: list[str]) -> list[float]:
        return [0.0 for _ in texts]

    @batched(max_batch_size=4)
    async def aencode(self, texts: list[str]) -> list[float]:
        return [0.0 for _ in texts]

    @batched
    def tokens(self, prompts: list[str]) -> Iterator[list[str]]:
        yield ["x" for _ in prompts]


def methods(encoder: Encoder) -> None:
    assert_type(encoder.encode, BatchedFunction[str, float])
    assert_type(encoder.encode("a"), float)
    assert_type(encoder.encode.map(["a"]), list[float])
    assert_type(encoder.tokens.stream("a"), Iterator[str])
    encoder.encode(["a"])  # error: arg-type


async def async_methods(encoder: Encoder) -> None:
    assert_type(await encoder.aencode("a"), float)
    assert_type(await encoder.encode.acall("a"), float)
    await encoder.aencode(["a"])  # error: arg-type


@batched
def tokens(prompts: list[str]) -> Iterator[list[str]]:
    yield [p.upper() for p in prompts]


@batched(max_wait_ms=0.5)
async def atokens(prompts: list[str]) -> AsyncIterator[list[str]]:
    yield [p.upper() for p in prompts]


def streams() -> None:
    assert_type(tokens.stream("a"), Iterator[str])
    tokens.stream(["a"])  # error: arg-type


async def async_streams() -> None:
    assert_type(tokens.astream("a"), AsyncIterator[str])
    assert_type(atokens.astream("a"), AsyncIterator[str])
    atokens.astream(["a"])  # error: arg-type


@batched
def pooled(texts: list[str]) -> Mapping[str, list[float]]:
    return {"pooled": [0.0 for _ in texts]}


def results_that_are_no_sequence() -> None:
    # A mapping (or an array) is split per item at run time: its type says nothing of
    # one item's result, but the items are still checked.
    assert_type(pooled("a"), Any)
    pooled(["a"])  # error: arg-type


@batched(collate=lambda texts: [t.encode() for t in texts])
def from_bytes(batch: list[bytes]) -> list[int]:
    return [len(b) for b in batch]


@batched(split=lambda out: out["rows"])
def split_rows(texts: list[str]) -> dict[str, list[int]]:
    return {"rows": [len(t) for t in texts]}


def collated_or_split() -> None:
    # collate changes what the function sees, split what it returns: no false errors.
    assert_type(from_bytes("a"), Any)
    assert_type(split_rows("a"), Any)


def takes_str_items(f: BatchedFunction[str, object]) -> None:
    """An annotation names the item and result types; results are covariant."""


def annotated_parameters() -> None:
    takes_str_items(lengths)
    takes_str_items(encoder_of_bytes)  # error: arg-type


@batched
def encoder_of_bytes(batch: list[bytes]) -> list[int]:
    return [len(b) for b in batch]
