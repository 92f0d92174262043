"""Identical requests computed once: in-flight coalescing and a result cache.

A layer in front of the serving core (`batchkit.serve.core`) with the core's
caller-facing methods (`make_request`, `submit`, `submit_many`, `backpressure`,
`give_up`, `answers`, `clock`), so that `batchkit.serve.callers` serves a
coalescing function exactly as it serves any other.

Each caller keeps its own request, its *ticket*: its item, its priority, and how it
is answered (a thread's lock, a task's future); a ticket is never queued. The first
caller of a key opens a *shared* request, the only one the core queues for that key;
callers of the same key that come while it waits or runs join it. When it is
answered (its `Request.on_answer`), every caller still attached gets the outcome: an
error as it is, a result as described in `Coalescer`. A caller that times out or is
cancelled while the shared request waits leaves it; when the last one leaves, the
shared request is withdrawn from the queue, so nothing runs for nobody. Once it runs,
its callers wait for its result as the callers of any running request do (a
`timeout` bounds the wait before the start).

Everything here is guarded by the core's lock: one lock for the queue and the
shared requests, so that a withdrawal and a join never cross. The cache has its own
lock, never held while the core's is taken.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import Callable, Hashable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchkit.errors import BatcherClosed, RequestTimeout
from batchkit.serve.core import ServingCore
from batchkit.serve.request import DONE, DROPPED, WAITING, Request, deliver, new_request
from batchkit.usercode import contained

log = logging.getLogger("batchkit")

KeyFunction = Callable[[Any], Hashable]
"""A coalescing key: item -> any hashable; equal keys mean equal results."""


def check_sharing(coalesce: object, cache: object, *, streams: bool) -> None:
    """Check `@batched`'s `coalesce` and `cache` options, at decoration.

    Args:
        coalesce: False, True or a key function.
        cache: None, or a mapping-like object.
        streams: The function is a generator function.

    Raises:
        TypeError: `coalesce` is neither a bool nor callable; `cache` has no
            `__getitem__` and `__setitem__`, or is a sequence; or either is given for a generator
            function (streams are not coalesced).
    """
    if not isinstance(coalesce, bool) and not callable(coalesce):
        raise TypeError(
            f"coalesce must be True, False or a function item -> hashable key, "
            f"got {type(coalesce).__name__}"
        )
    mapping_like = hasattr(cache, "__getitem__") and hasattr(cache, "__setitem__")
    if cache is not None and (not mapping_like or isinstance(cache, Sequence)):
        raise TypeError(
            f"cache must be a mapping (dict, cachetools.LRUCache, an adapter with "
            f"__getitem__ and __setitem__), got {type(cache).__name__}"
        )
    if streams and (coalesce is not False or cache is not None):
        option = "cache" if cache is not None else "coalesce"
        raise TypeError(
            f"{option}= is not supported for a generator (streaming) function: a "
            "stream's chunks are read as they come, so they are neither shared nor "
            "cached; leave it out, or cache the joined stream yourself"
        )


def own_copy(value: Any) -> Any:
    """A caller's own copy of a shared result: `copy.deepcopy`, or the value itself
    when it cannot be copied (an object holding a lock, say).

    Args:
        value: The shared result.
    """
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - not copyable: shared as it is (documented)
        return value


@dataclass(eq=False, slots=True)
class _Shared:
    """One key's request in the core, and the callers waiting for its outcome.

    Attributes:
        key: The coalescing key (with the group, if any).
        request: The request the core queues (never a caller's own).
        callers: The tickets attached now, first come first.
        admitted: The core accepted the request (with `when_full="block"` it may
            still wait for room).
    """

    key: Hashable
    request: Request
    callers: list[Request] = field(default_factory=list)
    admitted: bool = False


class Coalescer:
    """Identical requests computed once, in front of one serving core.

    Results: when a key's request succeeds, its first caller gets the result object
    and every other caller its own `copy.deepcopy` (`own_copy`), so a caller that
    mutates its result (a numpy array in place, say) never changes another's. With a
    cache, the cache keeps the object and every caller gets a copy. A result that
    cannot be deep-copied is shared as it is.

    Args:
        core: The function's serving core.
        coalesce: True (the item is the key) or a key function; False with a cache
            is the same as True (a key whose result is being computed is joined, not
            computed again).
        cache: Where successful results are kept by key; None for no cache.
        shares_loop: The driver serves one event loop (an async function): a shared
            request carries its first caller's loop.
    """

    def __init__(
        self,
        core: ServingCore,
        coalesce: bool | KeyFunction,
        cache: MutableMapping[Hashable, Any] | None,
        *,
        shares_loop: bool,
    ) -> None:
        self.core = core
        self.clock = core.clock
        self.cache = cache
        self._key_of_item: KeyFunction | None = None if isinstance(coalesce, bool) else coalesce
        self._shares_loop = shares_loop
        self._cache_lock = threading.Lock()
        self._shared: dict[Hashable, _Shared] = {}  # key -> its request, waiting or running
        self._joined: dict[Request, _Shared] = {}  # ticket -> what it waits for
        self._by_request: dict[Request, _Shared] = {}  # a queued request -> its own
        self._on_answer = self._answer  # one hook object: `deliver` groups by it
        self.answers = core.answers
        self.backpressure = None if core.backpressure is None else SharedBackpressure(self)

    # -- the caller side (what `batchkit.serve.callers` calls) ------------------
    def make_request(self, item: Any, priority: int, loop: Any, *, channel: Any = None) -> Request:
        """A caller's ticket for `item` (see `ServingCore.make_request`)."""
        if channel is not None:  # (refused at decoration: see `check_sharing`)
            raise TypeError(f"{self.core.name}: streams are not coalesced")
        return self.core.make_request(item, priority, loop)

    def submit(self, ticket: Request) -> None:
        """Answer `ticket` from the cache, or attach it to its key's request, opening
        (and queueing) one if none waits or runs.

        Args:
            ticket: A caller's request from `make_request`.

        Raises:
            BatcherClosed: The function is closed.
            QueueFull: A new request did not fit (`Overloaded` under a latency
                target); a caller that joins is never refused.
            TypeError: The key is not hashable.
            Exception: What the key function raised (this caller's alone).
        """
        key = self.key_of(ticket)
        self._refuse_if_closed()
        if self._answer_from_cache(ticket, key):
            return
        core = self.core
        with core.lock:
            if self._join_locked(ticket, key):
                return
            shared = self._open_locked(ticket, key)
            try:
                core.submit(shared.request)
            except BaseException:
                self._forget_locked(shared)
                raise
            shared.admitted = True

    def submit_many(self, tickets: Sequence[Request]) -> None:
        """`submit` for the items of one `map`: each is answered from the cache,
        joins, or opens a request; the new requests are queued all or none.

        Args:
            tickets: One caller's requests from `make_request`.

        Raises:
            BatcherClosed: The function is closed.
            QueueFull: The new requests do not all fit (nothing was queued or
                joined).
            TypeError: A key is not hashable (nothing was queued).
            Exception: What the key function raised (nothing was queued).
        """
        keys = [self.key_of(ticket) for ticket in tickets]
        self._refuse_if_closed()
        hits = {i: value for i, value in enumerate(map(self._cached, keys)) if value is not _MISS}
        core = self.core
        with core.lock:
            opened: list[_Shared] = []
            joined: list[Request] = []
            try:
                for i, (ticket, key) in enumerate(zip(tickets, keys)):
                    if i in hits:
                        continue
                    if self._join_locked(ticket, key):
                        joined.append(ticket)
                    else:
                        opened.append(self._open_locked(ticket, key))
                core.submit_many([shared.request for shared in opened])
            except BaseException:
                for ticket in joined:
                    self._detach_locked(ticket)
                    core.sched.stats.coalesced -= 1
                for shared in opened:
                    self._forget_locked(shared)
                raise
            for shared in opened:
                shared.admitted = True
        for i, value in hits.items():
            self._answer_hit(tickets[i], value)

    def give_up(self, ticket: Request, error: BaseException, *, timed_out: bool) -> bool:
        """A caller no longer waits (its `timeout` passed, or it was cancelled): it
        leaves its key's request if that still waits, which is withdrawn once nobody
        is left.

        Args:
            ticket: The caller's request.
            error: What the caller gets.
            timed_out: Count it as a timeout; False counts it as cancelled.

        Returns:
            True if the caller left (its ticket is answered with `error`); False if
            its request already runs or was answered (the outcome is on its way).
        """
        core = self.core
        with core.lock:
            shared = self._joined.get(ticket)
            if shared is None or shared.request.state is not WAITING:
                return False
            self._detach_locked(ticket)
            if not shared.callers and shared.admitted:
                # The last caller: withdraw the request (still waiting: checked under
                # this lock), counted and reported by the core as this caller's.
                self._unlist_locked(shared)
                core.give_up(shared.request, error, timed_out=timed_out)
            else:
                stats = core.sched.stats
                if timed_out:
                    stats.timeouts += 1
                else:
                    stats.cancelled += 1
                core.answers.report_drop("timeout" if timed_out else "cancelled", 1)
            ticket.state, ticket.error = DROPPED, error
            deliver([ticket])
        return True

    # -- keys and the cache --------------------------------------------------
    def key_of(self, ticket: Request) -> Hashable:
        """The coalescing key of a caller's item, with its group (if any).

        Raises:
            TypeError: The key is not hashable.
            Exception: What the key function raised.
        """
        item = ticket.item
        if self._key_of_item is None:
            key: Any = item
        else:
            try:
                key = self._key_of_item(item)
            except BaseException as exc:
                raise contained(exc, self.core.name, "coalesce") from None
        try:
            hash(key)
        except TypeError:
            how = (
                "pass coalesce=<a function item -> hashable key>"
                if self._key_of_item is None
                else "make coalesce= return a hashable key (a tuple, a str, bytes)"
            )
            raise TypeError(
                f"{self.core.name}: the coalescing key must be hashable, got "
                f"{type(key).__name__} ({how})"
            ) from None
        return key if self.core.group is None else (ticket.group, key)

    def _cached(self, key: Hashable) -> Any:
        """The cached result of `key`, or `_MISS`; a cache that fails to answer is
        logged and counts as a miss (the function computes it)."""
        if self.cache is None:
            return _MISS
        with self._cache_lock:
            try:
                return self.cache[key]
            except KeyError:
                return _MISS
            except Exception:
                log.exception("%s: the cache failed to look a key up", self.core.name)
                return _MISS

    def _answer_from_cache(self, ticket: Request, key: Hashable) -> bool:
        value = self._cached(key)
        if value is _MISS:
            return False
        self._answer_hit(ticket, value)
        return True

    def _answer_hit(self, ticket: Request, value: Any) -> None:
        with self.core.lock:
            self.core.sched.stats.cache_hits += 1
        ticket.state, ticket.value = DONE, own_copy(value)
        deliver([ticket])

    def _store(self, key: Hashable, value: Any) -> None:
        """Keep a success in the cache; a cache that fails is logged, not raised (the
        callers get their result all the same)."""
        assert self.cache is not None
        try:
            with self._cache_lock:
                self.cache[key] = value
        except Exception:
            log.exception("%s: the cache refused a result", self.core.name)

    def cache_clear(self) -> None:
        """Empty the cache (results being computed are stored when they arrive).

        Raises:
            TypeError: There is no cache, or it has no `clear()`.
        """
        clear = getattr(self.cache, "clear", None)
        if clear is None:
            raise TypeError(
                f"{self.core.name} has no cache to clear"
                if self.cache is None
                else f"{self.core.name}'s cache ({type(self.cache).__name__}) has no clear(): "
                "empty it through its own API"
            )
        with self._cache_lock:
            clear()

    # -- shared requests (under the core's lock) --------------------------------
    def _refuse_if_closed(self) -> None:
        if self.core.closed:  # (a join or a cache hit would answer a closed function)
            raise BatcherClosed(f"{self.core.name} is closed")

    def _join_locked(self, ticket: Request, key: Hashable) -> bool:
        """Attach `ticket` to its key's request if one waits or runs."""
        core = self.core
        # Refused as its own request would be. First: a driver that moves to this
        # loop answers the requests of the closed one, which unlists them.
        core.driver.check_loop_locked(ticket.loop)
        shared = self._shared.get(key)
        if shared is None:
            return False
        shared.callers.append(ticket)
        self._joined[ticket] = shared
        core.sched.stats.coalesced += 1
        core.sched.waiting.raise_priority(shared.request, ticket.priority)
        return True

    def _open_locked(self, ticket: Request, key: Hashable) -> _Shared:
        """A new shared request for `ticket`'s key (not queued yet), `ticket` its first
        caller."""
        loop = ticket.loop if self._shares_loop else None
        request = new_request(
            ticket.item, ticket.key, ticket.bucket, ticket.priority, loop, None, 0.0, ticket.group
        )
        request.future = None  # answered through on_answer, never awaited itself
        request.on_answer = self._on_answer
        shared = _Shared(key, request, [ticket])
        self._shared[key] = shared
        self._joined[ticket] = shared
        self._by_request[request] = shared
        return shared

    def _detach_locked(self, ticket: Request) -> None:
        shared = self._joined.pop(ticket)
        shared.callers.remove(ticket)

    def _unlist_locked(self, shared: _Shared) -> None:
        """New callers of the key no longer find `shared`."""
        if self._shared.get(shared.key) is shared:
            del self._shared[shared.key]

    def _forget_locked(self, shared: _Shared) -> None:
        """`shared` was never queued: unlist it and let go of its callers."""
        self._unlist_locked(shared)
        self._by_request.pop(shared.request, None)
        for ticket in shared.callers:
            self._joined.pop(ticket, None)
        shared.callers = []

    def _answer(self, requests: Sequence[Request]) -> None:
        """The outcomes of these shared requests are delivered (on any thread, the
        core's lock held or not; a batch's at once): hand each to every caller still
        attached to it, with one hand-off per caller's loop."""
        core = self.core
        with core.lock:
            answered = [self._by_request.pop(req) for req in requests]
        if self.cache is not None:  # stored before unlisting: no gap for a call to miss
            for shared in answered:
                if shared.request.error is None:
                    self._store(shared.key, shared.request.value)
        with core.lock:
            handed = []
            for shared in answered:
                self._unlist_locked(shared)
                handed.append(shared.callers)
                for ticket in shared.callers:
                    del self._joined[ticket]
                shared.callers = []
        tickets: list[Request] = []
        for shared, callers in zip(answered, handed):
            _hand_outcome(shared.request, callers, copies=self.cache is not None)
            tickets += callers
        deliver(tickets)

    def _refused(self, shared: _Shared, ticket: Request, error: BaseException) -> None:
        """A blocked admission of `shared` failed: `ticket` (its first caller) raises
        `error`. When that caller left (its `timeout` passed, or it was cancelled),
        the callers that joined meanwhile have the request queued now if there is
        room, else get `QueueFull`; any other error reaches them too."""
        core = self.core
        with core.lock:
            others = [t for t in shared.callers if t is not ticket]
            if others and isinstance(error, (RequestTimeout, asyncio.CancelledError)):
                self._detach_locked(ticket)
                try:
                    core.submit(shared.request)  # (no wait: none of them asked to)
                except BaseException as exc:
                    error = exc
                else:
                    shared.admitted = True
                    return
            self._forget_locked(shared)
        for other in others:
            other.state, other.error = DROPPED, error
        deliver(others)

    def _admitted(self, shared: _Shared) -> None:
        with self.core.lock:
            shared.admitted = True
            if not shared.callers:  # every caller left while it waited for room
                self._unlist_locked(shared)
                self.core.give_up(shared.request, self.core.answers.closed_error(), timed_out=False)

    def _open_or_join(self, ticket: Request) -> _Shared | None:
        """For a blocked admission: answer from the cache or join (None), or open a
        shared request that still has to be admitted."""
        key = self.key_of(ticket)
        self._refuse_if_closed()
        if self._answer_from_cache(ticket, key):
            return None
        with self.core.lock:
            if self._join_locked(ticket, key):
                return None
            return self._open_locked(ticket, key)


def _hand_outcome(request: Request, callers: Sequence[Request], *, copies: bool) -> None:
    """Give `request`'s outcome to its callers: an error as it is; a result to the
    first caller as it is (unless `copies`: the cache keeps it), to the others as a
    copy each (`own_copy`)."""
    for ticket in callers:
        ticket.state = DONE
        if request.error is not None:
            ticket.error = request.error
        elif copies:
            ticket.value = own_copy(request.value)
        else:
            ticket.value = request.value
            copies = True


class SharedBackpressure:
    """`when_full="block"` for a coalescing function: a new key's request waits for
    room (its first caller's `timeout` bounds the wait); callers of the key that
    come meanwhile join it and share that wait. If it fails, they get its error;
    if its caller left instead (timed out, cancelled), they have the request queued
    at once if there is room, else get `QueueFull`.

    Args:
        coalescer: The coalescing layer it admits for.
    """

    def __init__(self, coalescer: Coalescer) -> None:
        self._front = coalescer
        backpressure = coalescer.core.backpressure
        assert backpressure is not None
        self._backpressure = backpressure

    def submit(self, ticket: Request, timeout: float | None) -> None:
        """Admit `ticket` (see `Backpressure.submit`), from a thread."""
        shared = self._front._open_or_join(ticket)
        if shared is None:
            return
        try:
            self._backpressure.submit(shared.request, timeout)
        except BaseException as exc:
            self._front._refused(shared, ticket, exc)
            raise
        self._front._admitted(shared)

    async def asubmit(self, ticket: Request, timeout: float | None) -> None:
        """Admit `ticket` (see `Backpressure.asubmit`), from asyncio."""
        shared = self._front._open_or_join(ticket)
        if shared is None:
            return
        try:
            await self._backpressure.asubmit(shared.request, timeout)
        except BaseException as exc:
            self._front._refused(shared, ticket, exc)
            raise
        self._front._admitted(shared)


class _Miss:
    """The type of `_MISS`: a key the cache does not hold (None may be a result)."""


_MISS = _Miss()


def sharing_counts(core: ServingCore) -> tuple[int, int]:
    """`(coalesced callers, cache hits)` so far, cheaply (what a metrics scrape reads).

    Args:
        core: A batched function's serving core.
    """
    with core.lock:
        stats = core.sched.stats
        return stats.coalesced, stats.cache_hits
