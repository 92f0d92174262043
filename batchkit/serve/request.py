"""One caller's request: its item, where it waits, and how its outcome reaches it
(a thread caller is woken; an asyncio caller's future is resolved on its own loop)."""

from __future__ import annotations

import asyncio
import copy
import enum
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from batchkit.loops import call_on_loop
from batchkit.serve.channels import Channel


class RequestState(enum.Enum):
    """Where a request is in its life: `WAITING` -> `RUNNING` -> `DONE`, or
    `WAITING` -> `DROPPED` (timed out, cancelled, too late, or failed by a close before
    it ran)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()
    DROPPED = enum.auto()


# The states under their own names, as `signal.SIGINT` is `signal.Signals.SIGINT`.
WAITING = RequestState.WAITING
RUNNING = RequestState.RUNNING
DONE = RequestState.DONE
DROPPED = RequestState.DROPPED


class Request:
    """A queued item. Thread callers wait on a lock; asyncio callers on a future;
    streaming callers read a channel (its end is their outcome).

    The lock-as-event (acquired at creation, released once on completion) is the
    cheapest blocking wait CPython offers: one C-level lock per request. Under a
    latency target (`max_latency_ms`) it also gets a `deadline` at admission (its
    admission time plus the target); it is not set otherwise.

    Args:
        item: The caller's item.
        key: The policy's key of the item (0.0 for a keyless policy).
        bucket: The bucket it belongs to (`bucket_of(key)`; None for the one bucket).
        priority: Lower values are served first.
        loop: The event loop of an asyncio caller (its future is made there); None
            for a thread caller.
        channel: Where a streaming caller reads its chunks; None for a plain call.
        enqueued_at: When it was admitted, on the core's clock (admission sets it).
        group: The policy's group of the item (None without `group`); a grouped
            request's `bucket` is `(group, bucket_of(key))`.
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
        "channel",
        "deadline",
        "planned_answer",
        "group",
        "waiter",
        "on_answer",
        "on_settled",
    )

    item: Any
    key: float  # the policy's key of the item (0.0 for a keyless policy)
    bucket: Hashable  # bucket_of(key); None for the one bucket
    priority: int  # lower values are served first
    # Arrival order, set by Scheduler.add; it breaks ties between the heads of
    # different buckets at equal priority (bulk arrivals of one bucket keep 0).
    seq: int
    enqueued_at: float  # when it was admitted, on the core's clock
    state: RequestState
    value: Any
    error: BaseException | None
    future: asyncio.Future[Any] | None  # an asyncio caller's
    loop: asyncio.AbstractEventLoop | None  # an asyncio caller's running loop
    channel: Channel | None  # where a streaming caller reads its chunks
    deadline: float  # admission time + target; set only under a latency target
    # When a latency target's admission planned its answer; set only when one admitted
    # it on a prediction (not while warming up, nor as a probe).
    planned_answer: float
    group: Hashable  # the policy's group of the item (None without `group`)
    # A thread caller's wait: a lock held from creation until the outcome is stored
    # (`deliver` releases it); None for an asyncio or streaming caller.
    waiter: threading.Lock | None
    # Called, instead of answering a caller, when its outcome is delivered: once per
    # `deliver` with every request of it that has this same hook. Requests several
    # callers share (`batchkit.serve.coalesce`) answer them themselves, a batch's at
    # once. None for a caller's own request.
    on_answer: Callable[[Sequence[Request]], None] | None
    # Called once the outcome is stored, before the caller is woken, with the settled
    # requests delivered together (a layer above the core that orders requests: a
    # session's next request goes in). One function's requests all have the same
    # hook, or none; None for a plain request.
    on_settled: Callable[[Sequence[Request]], None] | None

    def __init__(
        self,
        item: Any,
        key: float,
        bucket: Hashable,
        priority: int,
        loop: asyncio.AbstractEventLoop | None = None,
        channel: Channel | None = None,
        enqueued_at: float = 0.0,
        group: Hashable = None,
    ) -> None:
        self.item = item
        self.key = key
        self.bucket = bucket
        self.priority = priority
        self.seq = 0
        self.enqueued_at = enqueued_at
        self.group = group
        self.state = WAITING
        self.value = None
        self.error = None
        self.loop = loop
        self.channel = channel
        self.on_answer = None
        self.on_settled = None
        if channel is not None or loop is not None:
            # An asyncio caller awaits its future; a streaming caller reads its channel.
            self.future = loop.create_future() if channel is None else None  # type: ignore[union-attr]
            self.waiter = None
        else:  # a thread caller waits on a lock held until it is answered
            self.future = None
            self.waiter = threading.Lock()
            self.waiter.acquire()

    def wait(self, timeout: float | None) -> bool:
        """Block a thread caller until done.

        Args:
            timeout: Seconds to wait at most; None for no bound.

        Returns:
            True once the outcome is stored; False if `timeout` passed first.

        Raises:
            TypeError: The request is an asyncio caller's (await its future).
        """
        if self.waiter is None:
            raise TypeError("an asyncio request is awaited (its future), not waited on")
        if self.waiter.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self.waiter.release()  # let a second wait() (after a timeout race) pass too
            return True
        return False

    def outcome(self) -> Any:
        """The result, or raise the request's own error (a copy of its batch's: see
        `own_error`)."""
        if self.error is not None:
            raise own_error(self.error)
        return self.value


def own_error(error: BaseException) -> BaseException:
    """A copy of `error` for one thread caller to raise, or `error` itself when it
    cannot be rebuilt.

    The callers of one failed batch share its error. Raised as it is by each, its
    traceback would collect every caller's frames (and keep their locals alive); a
    copy starts from the batch's traceback alone. It keeps the type, `args`,
    attributes, notes, `__cause__`, `__context__` and `__suppress_context__`.
    (An asyncio caller needs none: a future re-raises with the traceback it was set
    with.)

    Args:
        error: The error a request failed with.
    """
    try:
        mine = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception its own constructor cannot rebuild
        return error
    if type(mine) is not type(error) or mine is error:
        return error
    mine.__cause__ = error.__cause__
    mine.__context__ = error.__context__
    mine.__suppress_context__ = error.__suppress_context__
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):  # (a note one caller adds is not the others')
        mine.__dict__["__notes__"] = list(notes)
    return mine.with_traceback(error.__traceback__)


new_request = Request
"""The constructor of a waiting `Request`, under the name the rest of the package
calls it by: `new_request(item, key, bucket, priority, loop, channel, enqueued_at,
group)` (see `Request`'s arguments)."""


def resolve_futures(requests: Sequence[Request]) -> None:
    """On the requests' event loop: copy each outcome into its future (if still wanted).

    A `StopIteration` is wrapped in a `RuntimeError` (a future refuses it).

    Args:
        requests: Settled asyncio requests, all of this loop.
    """
    for req in requests:
        future = req.future
        if future is None:
            continue
        try:
            if req.error is None:
                future.set_result(req.value)
            else:
                future.set_exception(_settable(req.error))
        except asyncio.InvalidStateError:
            pass  # its caller stopped waiting (cancelled, or timed out) meanwhile


def _settable(error: BaseException) -> BaseException:
    """`error`, or a `RuntimeError` from it if a future refuses it (`StopIteration`)."""
    if not isinstance(error, StopIteration):
        return error
    wrapped = RuntimeError(f"the batch raised StopIteration: {error}")
    wrapped.__cause__ = error
    return wrapped


def resolve_on_loop(
    requests: Sequence[Request], values: Sequence[Any], loop: asyncio.AbstractEventLoop
) -> None:
    """On `loop`: mark a succeeded batch's requests done, resolve the futures of those
    awaiting there with `values`, and `deliver` the others (thread callers, streams,
    or callers from another loop).

    The requests' `on_settled` hook runs before any future is resolved; a
    cancelled caller's future is left alone.

    Args:
        requests: A batch's requests, every one succeeded.
        values: Their results, in the same order.
        loop: The running loop, this call's own.
    """
    hook = requests[0].on_settled if requests else None
    if hook is not None:
        for req, value in zip(requests, values):
            req.state, req.value = DONE, value
        hook(requests)
    others = []
    for req, value in zip(requests, values):
        req.state = DONE
        future = req.future
        if future is not None and req.loop is loop:
            try:  # noqa: SIM105 - suppress() would cost a context manager per item
                future.set_result(value)
            except asyncio.InvalidStateError:
                pass  # its caller was cancelled while the batch ran
        else:
            req.value = value
            others.append(req)
    if others:
        deliver(others)


def deliver(requests: Sequence[Request]) -> None:
    """Hand each settled request's outcome to its caller.

    The requests' `on_settled` hook runs first (see `Request`; it tells requests it
    has already seen apart). Thread callers are woken now; a stream's channel ends
    (with the request's error, if any); asyncio futures are resolved on their own
    loops (one hop per loop; a closed loop has nobody left to answer); shared
    requests are handed to their `on_answer`, once per hook, which answers their
    callers.

    Args:
        requests: Requests whose outcome (value or error) is stored.
    """
    by_loop: defaultdict[asyncio.AbstractEventLoop, list[Request]] = defaultdict(list)
    shared: dict[Callable[[Sequence[Request]], None], list[Request]] | None = None
    hook = requests[0].on_settled if requests else None
    if hook is not None:
        hook(requests)
    for req in requests:
        if req.on_answer is not None:
            if shared is None:
                shared = {}
            shared.setdefault(req.on_answer, []).append(req)
        elif req.channel is not None:
            req.channel.finish(req.error)  # (a stream already ended keeps its end)
        elif req.loop is not None:
            by_loop[req.loop].append(req)
        elif req.waiter is not None:  # a thread caller (the one without a loop)
            req.waiter.release()
    for loop, reqs in by_loop.items():
        call_on_loop(loop, resolve_futures, reqs)
    if shared is not None:
        for answer, reqs in shared.items():
            answer(reqs)
