"""Running one streaming batch: the recipe for a batch function that is a generator
(or an async generator), beside `batchkit.serve.execute` for plain ones.

Each `yield` is a sequence with one entry per item of the batch, in batch order: a
chunk for that item's caller, [`END`][batchkit.END] to end its stream, or an
`Exception` instance to fail its stream alone. The generator returning ends
every stream still open; raising fails them with its exception; a yield of the wrong
length fails them with an error stating both lengths. Once every caller has left (or
been answered), the generator is closed at its current `yield`.

Streams are not split and retried (chunks already delivered cannot be taken back),
but a `collate` that fails still costs only the malformed items: each item is then
collated alone to find them, and the rest run together. Nor is `batch_timeout`
applied to them. What the user's code raises (`collate`, the generator, its
closing) is settled by the rule of `batchkit.usercode`: the streams it concerns fail,
a `SystemExit` as a `BatchInterrupted`, and the worker goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from batchkit.collate.inverse import Inverse
from batchkit.serve.channels import END, Channel
from batchkit.serve.execute import BatchRun, layout_of, results_per_item
from batchkit.serve.options import Clock, Options
from batchkit.serve.request import Request
from batchkit.usercode import contained, run_hook

log = logging.getLogger("batchkit")


class StreamBatch:
    """The streams of one batch: which are open, and where each entry goes.

    Args:
        requests: The batch's requests, each with its channel.
        options: The function's options (policy, `collate`).
        name: The function's name, for error messages.
    """

    def __init__(self, requests: Sequence[Request], options: Options, name: str) -> None:
        self.run: BatchRun = BatchRun(requests, options)
        self.name = name
        self.positions: list[int] = []  # batch positions of the items the generator sees
        self.padded = 0
        self.argument: Any = None
        self.layout: Inverse | None = None  # where each item went, when collate made a layout

    @property
    def channels(self) -> list[Channel]:
        return [self.run.requests[i].channel for i in self.positions]  # type: ignore[misc]

    def prepare(self, options: Options) -> bool:
        """Collate the batch (the malformed items fail alone).

        Args:
            options: The function's options (`collate`, and the policy's padded size).

        Returns:
            True when there is an argument to call the generator function with;
            False if no item is left to run.
        """
        requests = self.run.requests
        self.positions = list(range(len(requests)))
        if options.collate is not None:
            try:
                self.argument = self._collate(self.positions, options)
                return True
            except BaseException:  # noqa: BLE001 - find the malformed items, run the rest
                self.positions = [i for i in self.positions if self._collates_alone(i, options)]
        if not self.positions:
            return False
        try:
            self.argument = self._collate(self.positions, options)
        except BaseException as exc:  # noqa: BLE001 - they collate alone but not together
            self._fail_open(contained(exc, self.name, "collate"))
            return False
        return True

    def _collate(self, positions: list[int], options: Options) -> Any:
        items = [self.run.requests[i].item for i in positions]
        self.padded = options.policy.padded_size(len(items))
        items.extend([items[-1]] * (self.padded - len(items)))  # strict sizes pad up
        argument = options.collate(items) if options.collate is not None else items
        self.layout = layout_of(argument)
        return argument

    def _collates_alone(self, position: int, options: Options) -> bool:
        assert options.collate is not None
        try:
            options.collate([self.run.requests[position].item])
        except BaseException as exc:  # noqa: BLE001 - this item's own error, for its caller
            self.run.errors[position] = contained(exc, self.name, "collate")
            self.run.isolated += 1
            return False
        return True

    def take(self, entries: Any, clock: Clock) -> bool:
        """One yield of the generator: note the first chunk's time, hand the entries
        to their streams; whether nobody reads any more (the generator may stop).

        Args:
            entries: What the generator yielded (see `dispatch`).
            clock: The clock the first chunk's time is read on.

        Returns:
            True once every stream has ended or been left.
        """
        if self.run.first_output_at is None:
            self.run.first_output_at = clock()
        self.dispatch(entries)
        return self.finished

    def dispatch(self, entries: Any) -> None:
        """Hand one yield's entries to their streams.

        Args:
            entries: What the generator yielded: one entry per item (padding
                included), each a chunk, `END` or an exception instance; or, as a
                plain function's output, an array or mapping that the batch's layout
                (or its leading axis) splits per item (see `results_per_item`).

        Raises:
            TypeError: `entries` has no `len()`.
            ValueError: It does not hold one entry per item.
        """
        entries = results_per_item(
            entries, self.layout, self.padded, self.name, "yielded", self.run.per_token
        )
        for position, entry in zip(self.positions, entries):
            channel = self.run.requests[position].channel
            assert channel is not None
            if channel.done or position in self.run.errors:
                continue  # ended, failed or left: its later entries are ignored
            if entry is END:
                channel.finish(None)
            elif isinstance(entry, Exception):
                self.run.errors[position] = entry
                channel.finish(entry)
            else:
                channel.put(entry)

    @property
    def finished(self) -> bool:
        """Every stream ended or was left: nobody reads what the generator makes."""
        return all(channel.done for channel in self.channels)

    def _fail_open(self, error: BaseException) -> None:
        for position, channel in zip(self.positions, self.channels):
            if not channel.done and position not in self.run.errors:
                self.run.errors[position] = error

    def ended(self, error: BaseException | None) -> BatchRun:
        """The generator ended: settle every stream still open.

        Args:
            error: What it raised (every open stream fails with it); None when it
                returned.

        Returns:
            The batch's run, its outcomes settled.
        """
        if error is not None:
            self._fail_open(error)
        return self.run


def run_stream_sync(
    fn: Callable[[Any], Iterator[Any]],
    requests: Sequence[Request],
    options: Options,
    name: str,
    clock: Clock,
) -> BatchRun:
    """Iterate a generator batch function on this thread; never raises.

    Args:
        fn: The generator function.
        requests: The batch's requests.
        options: The function's options.
        name: The function's name, for error messages.
        clock: The clock the first chunk's time is read on.

    Returns:
        The settled run.
    """
    stream = StreamBatch(requests, options, name)
    if not stream.prepare(options):
        return stream.run
    error: BaseException | None = None
    stream.run.calls = 1
    generator: Iterator[Any] | None = None
    try:
        generator = fn(stream.argument)
        for entries in generator:
            if stream.take(entries, clock):
                break
    except BaseException as exc:  # noqa: BLE001 - the worker must survive anything
        error = contained(exc, name)
    finally:
        _close(generator)
    return stream.ended(error)


async def run_stream_async(
    fn: Callable[[Any], AsyncIterator[Any]],
    requests: Sequence[Request],
    options: Options,
    name: str,
    clock: Clock,
) -> BatchRun:
    """`run_stream_sync` for an async generator function, on the event loop: the same
    arguments and result; it raises only a cancellation. Anything else the generator
    raises fails its open streams, not the task running the batch (a `SystemExit`
    as a `BatchInterrupted`: see `batchkit.usercode`)."""
    stream = StreamBatch(requests, options, name)
    if not stream.prepare(options):
        return stream.run
    error: BaseException | None = None
    stream.run.calls = 1
    generator: AsyncIterator[Any] | None = None
    try:
        generator = fn(stream.argument)
        async for entries in generator:
            if stream.take(entries, clock):
                break
    except asyncio.CancelledError:
        raise  # (this batch's task is cancelled: its streams are settled by the driver)
    except BaseException as exc:  # noqa: BLE001 - its streams get it, not the task
        error = contained(exc, name)
    finally:
        await _aclose(generator)
    return stream.ended(error)


def _close(generator: Iterator[Any] | None) -> None:
    close = getattr(generator, "close", None)
    if close is not None:  # GeneratorExit at its current yield; it may yield again, or exit
        run_hook(close, what="closing a streaming batch function's generator")


async def _aclose(generator: AsyncIterator[Any] | None) -> None:
    aclose = getattr(generator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - as run_hook, awaited
            log.exception("batchkit: closing a streaming batch function's generator failed")
