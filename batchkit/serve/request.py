"""One caller's request: its item, where it waits, how its outcome reaches it, and how
an asyncio caller awaits it (with its timeout and cancellation)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Hashable, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchkit.serve.runtime import Runtime


class State(IntEnum):
    """A request's life: waiting -> running -> done, or waiting -> dropped."""

    WAITING = 0
    RUNNING = 1
    DONE = 2
    DROPPED = 3  # timed out, cancelled or failed by close before it ran


# Module constants: ``State.WAITING`` is a slower, metaclass lookup.
WAITING, RUNNING, DONE = State.WAITING, State.RUNNING, State.DONE


class Request:
    """A queued item. Thread callers wait on a lock; asyncio callers on a future.

    The lock-as-event trick (acquired at creation, released once on completion)
    is the cheapest blocking wait CPython offers: one C-level lock per request.
    """

    __slots__ = (
        "item",
        "key",
        "bucket",
        "priority",
        "seq",
        "enqueued_at",
        "state",
        "value",
        "error",
        "future",
        "loop",
        "_done",
    )
    # seq: arrival order, set by Scheduler.add; it breaks ties between the heads of
    # different buckets at equal priority (so a keyless policy's bulk arrivals keep 0).

    def __init__(
        self,
        item: Any,
        key: float,
        bucket: Hashable,
        priority: int,
        loop: asyncio.AbstractEventLoop | None = None,
        enqueued_at: float = 0.0,
    ) -> None:
        self.item = item
        self.key = key
        self.bucket = bucket
        self.priority = priority
        self.seq = 0
        self.enqueued_at = enqueued_at  # the arrival time: set at admission
        self.state = WAITING
        self.value: Any = None
        self.error: BaseException | None = None
        self.loop = loop
        if loop is None:
            self.future: asyncio.Future[Any] | None = None
            self._done: threading.Lock | None = threading.Lock()
            self._done.acquire()
        else:
            self.future = loop.create_future()
            self._done = None

    def wait(self, timeout: float | None) -> bool:
        """Block a thread caller until done; False if ``timeout`` seconds passed first."""
        assert self._done is not None, "asyncio requests are awaited, not waited on"
        if self._done.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._done.release()  # let a second wait() (after a timeout race) pass too
            return True
        return False

    def notify_thread(self) -> None:
        """Wake the thread caller (the outcome is already stored)."""
        if self._done is not None:
            self._done.release()

    def outcome(self) -> Any:
        """The result, or raise the request's own error."""
        if self.error is not None:
            raise self.error
        return self.value


def resolve_futures(requests: list[Request]) -> None:
    """On the requests' event loop: copy each outcome into its future (if still wanted)."""
    for req in requests:
        fut = req.future
        if fut is None or fut.done():
            continue
        error = req.error
        if error is not None:
            if isinstance(error, StopIteration):  # a future refuses it (TypeError)
                wrapped = RuntimeError(f"the batch raised StopIteration: {error}")
                wrapped.__cause__ = error
                error = wrapped
            fut.set_exception(error)
        else:
            fut.set_result(req.value)


def resolve_on_loop(
    requests: Sequence[Request], values: list[Any], loop: asyncio.AbstractEventLoop
) -> list[Request]:
    """On ``loop``: resolve the futures of the requests awaiting there with ``values``
    (a cancelled caller's is left alone); return the others (admitted from another loop
    as this one took over), their values stored, for :func:`deliver`."""
    others = []
    for req, value in zip(requests, values):
        if req.loop is loop:
            future = req.future
            if not future.done():  # type: ignore[union-attr]
                future.set_result(value)  # type: ignore[union-attr]
        else:
            req.value = value
            others.append(req)
    return others


def deliver(requests: list[Request]) -> None:
    """Wake thread callers now; resolve asyncio futures on their own loops (one hop per loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    for req in requests:
        if req.loop is None:
            req.notify_thread()
        else:
            by_loop.setdefault(req.loop, []).append(req)
    for loop, reqs in by_loop.items():
        if asyncio._get_running_loop() is loop:
            resolve_futures(reqs)
        else:
            # A closed loop raises RuntimeError: nobody is left there to answer.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(resolve_futures, reqs)


async def await_request(runtime: Runtime, req: Request, timeout: float | None) -> Any:
    """Await an asyncio request, honouring its timeout and its caller's cancellation."""
    fut = req.future
    assert fut is not None and req.loop is not None
    timer = None
    if timeout is not None:

        def expire() -> None:
            runtime.give_up(req, runtime.timeout_error(timeout), timed_out=True)

        timer = req.loop.call_later(max(timeout, 0.0), expire)
    try:
        return await fut
    except asyncio.CancelledError:
        runtime.give_up(req, asyncio.CancelledError(), timed_out=False)
        raise
    finally:
        if timer is not None:
            timer.cancel()
