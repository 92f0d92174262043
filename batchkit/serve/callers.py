"""How a caller waits for its answer: one item or many, from a thread (blocking) or
from asyncio (awaiting, never blocking the loop), with its timeout and cancellation.

Plain functions over a `batchkit.serve.core.ServingCore`; both drivers use them. A
`timeout` bounds the wait before the item starts running, read on the batcher's
clock; it is checked before anything is queued (`checked_timeout`), so a call refused
for its `timeout` never runs its item.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, NoReturn, Protocol

from batchkit.batchers.checks import LONGEST_WAIT_S
from batchkit.errors import RequestTimeout
from batchkit.serve.answers import Answers
from batchkit.serve.channels import LoopChannel, Message, ThreadChannel
from batchkit.serve.core import ServingCore
from batchkit.serve.options import Clock
from batchkit.serve.request import Request, own_error


class WaitForRoom(Protocol):
    """Admission that may wait for room (`when_full="block"`): the core's
    `Backpressure`, or a layer's in front of it."""

    def submit(self, req: Request, timeout: float | None) -> None:
        """Admit `req` from a thread, waiting for room within `timeout`."""
        ...

    async def asubmit(self, req: Request, timeout: float | None) -> None:
        """Admit `req` from asyncio, waiting for room within `timeout`."""
        ...


class Front(Protocol):
    """What a plain (not streaming) caller talks to: the serving core itself, or a
    layer in front of it with the same methods (`batchkit.serve.coalesce`)."""

    @property
    def clock(self) -> Clock:
        """The function's clock."""
        ...

    @property
    def backpressure(self) -> WaitForRoom | None:
        """The admission that waits for room; None when a full queue refuses."""
        ...

    @property
    def answers(self) -> Answers:
        """Where the errors callers get are made (`Answers.timeout_error`)."""
        ...

    def make_request(
        self, item: Any, priority: int, loop: asyncio.AbstractEventLoop | None
    ) -> Request:
        """A caller's request for `item` (see `ServingCore.make_request`)."""
        ...

    def submit(self, req: Request) -> None:
        """Enqueue one request (see `ServingCore.submit`)."""
        ...

    def submit_many(self, reqs: Sequence[Request]) -> None:
        """Enqueue one caller's requests, all or none (see `ServingCore.submit_many`)."""
        ...

    def give_up(self, req: Request, error: BaseException, *, timed_out: bool) -> bool:
        """Withdraw a request its caller no longer waits for (see `ServingCore.give_up`)."""
        ...


def checked_timeout(timeout: object) -> float | None:
    """A caller's `timeout` as the bound it means, checked before anything is queued.

    Args:
        timeout: Seconds (a real number >= 0); None or `math.inf` for no bound.

    Returns:
        The seconds as a float, or None for no bound.

    Raises:
        TypeError: `timeout` is not a real number (a `bool` or a string neither).
        ValueError: It is NaN or negative, or finite and longer than the platform's
            timers take (`threading.TIMEOUT_MAX` seconds).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    seconds = float(timeout)
    if not seconds >= 0.0:  # (NaN too: every comparison with it is False)
        raise ValueError(
            f"timeout must be a number of seconds >= 0 (None or math.inf for no bound), "
            f"got {timeout!r}"
        )
    if seconds == math.inf:
        return None
    if seconds > LONGEST_WAIT_S:  # (a wait would raise OverflowError once it is queued)
        raise ValueError(
            f"timeout={timeout!r} is longer than this platform's timers take "
            f"(threading.TIMEOUT_MAX: {LONGEST_WAIT_S:.4g} seconds); use None or "
            "math.inf for no bound"
        )
    return seconds


def _started(core: Front, timeout: float | None) -> float:
    """When a wait bounded by `timeout` starts (the clock is read only if there is one)."""
    return 0.0 if timeout is None else core.clock()


def _left(core: Front, timeout: float | None, started: float) -> float | None:
    """What is left of `timeout` since `started` (on the core's clock)."""
    return None if timeout is None else max(timeout - (core.clock() - started), 0.0)


# -- from a thread ------------------------------------------------------------------
def call(core: Front, item: Any, priority: int, timeout: float | None) -> Any:
    """One item from a thread: block until its result (or error).

    Args:
        core: The function's serving core.
        item: The item.
        priority: Lower values are served first.
        timeout: Seconds the item may wait before it starts; None for no bound.

    Returns:
        The item's result.

    Raises:
        RequestTimeout: It did not start within `timeout`.
        TypeError: `timeout` is not a number (nothing was queued).
        ValueError: `timeout` is NaN or negative (nothing was queued).
    """
    timeout = checked_timeout(timeout)
    req = core.make_request(item, priority, None)
    left = timeout
    if core.backpressure is None:
        core.submit(req)  # at once: the timeout is all still left
    else:
        started = _started(core, timeout)
        core.backpressure.submit(req, timeout)  # may wait for room
        left = _left(core, timeout, started)
    if not req.wait(left):
        assert timeout is not None
        if core.give_up(req, core.answers.timeout_error(timeout), timed_out=True):
            raise req.error  # type: ignore[misc]
        req.wait(None)  # it started running: its result is on the way
    return req.outcome()


def call_many(core: Front, items: Iterable[Any], priority: int, timeout: float | None) -> list[Any]:
    """Many items from a thread; results in input order. Raises the first failed
    item's error (in input order) once every item has finished.

    Args:
        core: The function's serving core.
        items: The items.
        priority: Every item's priority.
        timeout: Seconds, from this call, within which each item must start; None
            for no bound.

    Returns:
        One result per item, in input order.

    Raises:
        TypeError: `timeout` is not a number (nothing was queued).
        ValueError: `timeout` is NaN or negative (nothing was queued).
    """
    timeout = checked_timeout(timeout)
    reqs = [core.make_request(x, priority, None) for x in items]
    # Every item's timeout runs from this call, as if each were called alone now (a
    # blocked enqueue included): at the deadline, items not yet started are withdrawn.
    started = _started(core, timeout)
    if core.backpressure is not None:
        for i, req in enumerate(reqs):
            try:
                core.backpressure.submit(req, _left(core, timeout, started))
            except BaseException as exc:
                _withdraw_and_raise(core, reqs[:i], exc, timeout)
    else:
        core.submit_many(reqs)
    for i, req in enumerate(reqs):
        if not req.wait(_left(core, timeout, started)):
            assert timeout is not None
            for late in reqs[i:]:
                core.give_up(late, core.answers.timeout_error(timeout), timed_out=True)
            timeout = None
            req.wait(None)  # answered now: by the timeout, or by its running batch
    return [req.outcome() for req in reqs]


def _withdraw_and_raise(
    core: Front, reqs: Sequence[Request], error: BaseException, timeout: float | None
) -> NoReturn:
    """Withdraw the items of a `map` admitted before `error` stopped it, and raise.

    Args:
        core: The function's serving core.
        reqs: The requests admitted so far.
        error: What stopped the admission; each withdrawn request gets it.
        timeout: The caller's `timeout`.

    Raises:
        BaseException: `error`, or for a timeout a `RequestTimeout` naming the
            caller's `timeout` (not what was left of it).
    """
    timed_out = isinstance(error, RequestTimeout)
    for req in reqs:
        core.give_up(req, error, timed_out=timed_out)
    if timed_out and timeout is not None:
        raise core.answers.timeout_error(timeout) from None
    raise error


# -- from asyncio --------------------------------------------------------------------
async def acall(core: Front, item: Any, priority: int, timeout: float | None) -> Any:
    """One item from asyncio: await its result, honouring `timeout` and cancellation.

    Args:
        core: The function's serving core.
        item: The item.
        priority: Lower values are served first.
        timeout: Seconds the item may wait before it starts; None for no bound.

    Returns:
        The item's result.

    Raises:
        RequestTimeout: It did not start within `timeout` (it was withdrawn).
        asyncio.CancelledError: The caller was cancelled (the item was withdrawn, if
            it had not started).
        TypeError: `timeout` is not a number (nothing was queued).
        ValueError: `timeout` is NaN or negative (nothing was queued).
    """
    timeout = checked_timeout(timeout)
    req = core.make_request(item, priority, asyncio.get_running_loop())
    if core.backpressure is None:
        core.submit(req)  # at once: the timeout is all still left
    else:
        started = _started(core, timeout)
        await core.backpressure.asubmit(req, timeout)  # may wait for room
        timeout = _left(core, timeout, started)
    return await await_request(core, req, timeout)


async def amap(
    core: Front, items: Iterable[Any], priority: int, timeout: float | None
) -> list[Any]:
    """`call_many` from asyncio: the same arguments, results and errors; each item
    is awaited on the caller's loop."""
    timeout = checked_timeout(timeout)
    loop = asyncio.get_running_loop()
    reqs = [core.make_request(x, priority, loop) for x in items]
    started = _started(core, timeout)
    if core.backpressure is not None:
        for i, req in enumerate(reqs):
            try:
                await core.backpressure.asubmit(req, _left(core, timeout, started))
            except BaseException as exc:
                _withdraw_and_raise(core, reqs[:i], exc, timeout)
    else:
        core.submit_many(reqs)
    left = _left(core, timeout, started)
    waits = [asyncio.ensure_future(await_request(core, r, left)) for r in reqs]
    outcomes = await asyncio.gather(*waits, return_exceptions=True)
    for out in outcomes:
        if isinstance(out, BaseException):
            raise out
    return list(outcomes)


async def await_request(core: Front, req: Request, timeout: float | None) -> Any:
    """Await an asyncio request, honouring its timeout and its caller's cancellation.

    Args:
        core: The function's serving core.
        req: The admitted request (it has a future).
        timeout: Seconds left before it must have started; None for no bound.

    Returns:
        The request's result.

    Raises:
        RequestTimeout: It did not start in time (it was withdrawn).
        asyncio.CancelledError: The caller was cancelled (it was withdrawn, if it
            had not started).
    """
    fut, loop = req.future, req.loop
    assert fut is not None and loop is not None
    timer = None
    if timeout is not None:
        timer = loop.call_later(timeout, _expire, core, req, timeout)
    try:
        return await fut
    except asyncio.CancelledError:
        _withdraw_cancelled(core, req)
        raise
    finally:
        if timer is not None:
            timer.cancel()


def _withdraw_cancelled(core: Front, req: Request) -> None:
    """The caller's task was cancelled: its request is withdrawn if it still waits."""
    core.give_up(req, asyncio.CancelledError(), timed_out=False)


def _expire(core: Front, req: Request, timeout: float) -> None:
    core.give_up(req, core.answers.timeout_error(timeout), timed_out=True)


# -- streams ----------------------------------------------------------------------------
def _unpack(message: Message, *, copy_error: bool = False) -> Any:
    """A chunk's value; raise StopIteration at the end, or the stream's error (with
    `copy_error`, a thread reader's own copy of it: see `own_error`)."""
    kind, value = message
    if kind == "chunk":
        return value
    if value is not None:
        raise own_error(value) if copy_error else value
    raise StopIteration


class ThreadStream(Iterator[Any]):
    """The chunks of one item's stream, read from a thread (`f.stream(x)`).

    The request is queued when the stream is made, so that streams made one after
    another batch together; `close()` (or dropping the iterator) leaves the stream.

    Args:
        core: The function's serving core.
        item: The item.
        priority: Lower values are served first.
        timeout: Seconds the item may wait before its batch starts; None for no
            bound.
    """

    def __init__(self, core: ServingCore, item: Any, priority: int, timeout: float | None) -> None:
        timeout = checked_timeout(timeout)
        self._core = core
        self._channel = ThreadChannel()
        self._req = core.make_request(item, priority, None, channel=self._channel)
        self._timeout = timeout
        self._started = _started(core, timeout)
        self._open = False
        if core.backpressure is not None:
            core.backpressure.submit(self._req, timeout)
        else:
            core.submit(self._req)
        self._open = True

    def __iter__(self) -> ThreadStream:
        return self

    def __next__(self) -> Any:
        if not self._open:
            raise StopIteration
        left = _left(self._core, self._timeout, self._started)
        message = self._channel.get(left)
        if message is None:  # the timeout passed first
            assert self._timeout is not None
            error = self._core.answers.timeout_error(self._timeout)
            if self._core.give_up(self._req, error, timed_out=True):
                self._open = False
                raise error
            message = self._channel.get(None)  # it started: its chunks are on the way
            assert message is not None  # (no bound: it waits for one)
        self._timeout = None  # the batch has started: no bound on later chunks
        try:
            # (The batch's other streams end with the same error.)
            return _unpack(message, copy_error=True)
        except BaseException:
            self._open = False
            raise

    def close(self) -> None:
        """Stop reading: the rest of this stream is dropped (nobody else's)."""
        if self._open:
            self._open = False
            self._core.leave(self._req)

    def __del__(self) -> None:
        # A dropped iterator leaves its stream. (Guarded: finalizers also run at
        # interpreter exit, when the batcher may be half torn down.)
        with contextlib.suppress(Exception):
            self.close()


class LoopStream(AsyncIterator[Any]):
    """The chunks of one item's stream, read from asyncio (`f.astream(x)`).

    Made inside a running event loop, with `ThreadStream`'s arguments. Queued when
    made (or, with `when_full="block"`, at the first `__anext__`, which may wait for
    room); `aclose()`, a cancelled read or dropping it leaves the stream.
    """

    def __init__(self, core: ServingCore, item: Any, priority: int, timeout: float | None) -> None:
        timeout = checked_timeout(timeout)
        loop = asyncio.get_running_loop()
        self._core = core
        self._channel = LoopChannel(loop)
        self._req = core.make_request(item, priority, loop, channel=self._channel)
        self._timeout = timeout
        self._started = _started(core, timeout)
        self._open = False
        self._queued = core.backpressure is None
        if self._queued:
            core.submit(self._req)
        self._open = True

    def __aiter__(self) -> LoopStream:
        return self

    async def __anext__(self) -> Any:
        if not self._open:
            raise StopAsyncIteration
        try:
            message = await self._next_message()
        except asyncio.CancelledError:
            self._leave()
            raise
        try:
            return _unpack(message)
        except StopIteration:
            self._open = False
            raise StopAsyncIteration from None
        except BaseException:
            self._open = False
            raise

    async def _next_message(self) -> Message:
        core = self._core
        if not self._queued:
            assert core.backpressure is not None
            await core.backpressure.asubmit(self._req, self._timeout)
            self._queued = True
        left = _left(core, self._timeout, self._started)
        if left is None:
            return await self._channel.get()
        try:
            return await asyncio.wait_for(self._channel.get(), left)
        except asyncio.TimeoutError:
            assert self._timeout is not None
            error = core.answers.timeout_error(self._timeout)
            if core.give_up(self._req, error, timed_out=True):
                self._open = False
                raise error from None
            return await self._channel.get()  # it started: its chunks are on the way
        finally:
            self._timeout = None  # from the first chunk on, no bound

    async def aclose(self) -> None:
        """Stop reading: the rest of this stream is dropped (nobody else's)."""
        self._leave()

    def _leave(self) -> None:
        if self._open:
            self._open = False
            if self._queued:  # (a caller blocked on a full queue never queued it)
                self._core.leave(self._req)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (see ThreadStream.__del__)
            self._leave()
