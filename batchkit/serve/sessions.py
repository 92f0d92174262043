"""Stateful sessions: a layer above the serving core that keeps one state per session
and runs each session's requests in order, one at a time.

The model:

- Each session (a hashable key) has a FIFO of its requests. Only its head request is
  in the core (waiting or running); the others wait here. So no two requests of one
  session are ever in one batch or in flight together, and the scheduler needs no
  change: requests of different sessions batch together under the usual policy.
- When the head settles (answered, failed, timed out, cancelled), its request's
  `on_settled` hook (run before its caller is woken) submits the next one, so that the
  session's next chunk is queued before the caller even sees the result.
- The core runs `batch_function`, a wrapper: it gathers each item's state from the
  store, calls the user's `fn(argument, states)`, checks that it returned
  `(results, new_states)` with one entry per item, and writes the new states back.
  A request that then fails anyway (its result is an exception, the batch timed out,
  a close failed it, its caller cancelled it while it ran) puts its session's state
  back to what it was before it when it settles: only one request of a session is in
  flight, so nothing else can have changed it meanwhile. A part of a batch that raised
  writes nothing, so an out-of-memory split or `isolate_errors` re-runs its items
  from the states before it.
- Lifetime: `end_session` or `end=True` ends a session once its queued requests have
  settled; `session_idle_s` ends sessions with nothing queued (checked on each call,
  `end_session` and `stats()`, on the core's clock); `max_sessions` bounds the live
  sessions: a new one past it is refused (`TooManySessions`) or waits for room.

One lock (`Sessions.lock`) guards the sessions and the store. It is a leaf: nothing
else is acquired under it (the core's lock is taken outside it), and the hook runs
under the core's lock on some paths, so the order is always core -> sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from batchkit.errors import BatcherClosed, TooManySessions
from batchkit.serve.callers import checked_timeout
from batchkit.serve.core import ServingCore
from batchkit.serve.execute import layout_of, results_per_item
from batchkit.serve.options import Options, SessionOptions
from batchkit.serve.request import Request, deliver, own_error
from batchkit.serve.session_states import ObjectStates, StackedStates, StateStore

__all__ = ["SessionBatch", "Sessions"]

_UNSET: Any = object()  # no state given (an item that does not start a session)


class _Session:
    """One session: its slot in the store, its head request (in the core) and the
    requests queued behind it."""

    __slots__ = ("key", "slot", "head", "queue", "ends_with_last", "first_state", "last_used")

    def __init__(self, key: Hashable, now: float) -> None:
        self.key = key
        self.slot = -1  # -1 while it waits for room (when_sessions_full="block")
        self.head: Request | None = None
        self.queue: deque[Request] = deque()
        # Whether its last request ends it: a later call then starts a new session.
        self.ends_with_last = False
        self.first_state: Any = _UNSET  # its first state, while it waits for room
        self.last_used = now

    @property
    def waiting_for_room(self) -> bool:
        return self.slot < 0

    @property
    def busy(self) -> bool:
        return self.head is not None or bool(self.queue)


class _Item:
    """What the core queues for a session's request: the caller's chunk, and where
    its session stands."""

    __slots__ = (
        "chunk",
        "session",
        "end",
        "first_state",
        "committed",
        "previous",
        "settled",
        "withdrawn",
        "cancelled",
    )

    def __init__(self, chunk: Any, end: bool) -> None:
        self.chunk = chunk
        self.session: _Session | None = None
        self.end = end  # the session ends once this request settles
        self.first_state: Any = _UNSET  # it starts its session over with this state
        self.committed = False  # its new state was written
        self.previous: Any = _UNSET  # the state before it, while it may still fail
        self.settled = False
        self.withdrawn = False  # timed out or cancelled while queued here
        self.cancelled = False  # its caller was cancelled


@dataclasses.dataclass(frozen=True)
class SessionBatch:
    """The argument the core passes to `Sessions.batch_function`: the batch's items
    and the user's argument made of their chunks (`collate(chunks)`, or the list)."""

    items: list[_Item]
    argument: Any


class Sessions:
    """The sessions of one stateful batched function.

    Args:
        fn: The user's batch function, `fn(argument, states) -> (results, new_states)`.
        options: The function's options (their `sessions` set); `collate` and `split`
            are applied here, around `fn`.
        name: The function's name, for errors.
        is_async: `fn` is a coroutine function.
    """

    def __init__(
        self, fn: Callable[..., Any], options: Options, name: str, *, is_async: bool
    ) -> None:
        settings = options.sessions
        assert settings is not None
        self.fn = fn
        self.settings: SessionOptions = settings
        self.name = name
        self.collate = options.collate
        self.split = options.split
        self.clock = options.clock
        self.lock = threading.Lock()
        self.store: StateStore = (
            StackedStates(settings.max_sessions or 16) if settings.stack_states else ObjectStates()
        )
        # Sessions by key, least recently used first (idle ones leave from the front).
        self.sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        self.live = 0  # sessions holding a slot
        self.waiting_for_room: deque[_Session] = deque()
        self.ended = 0
        self.evicted = 0
        self.closed = False
        self.core: ServingCore | None = None
        self.batch_function: Callable[[SessionBatch], Any] = (
            self._call_async if is_async else self._call
        )

    def core_options(self, options: Options) -> Options:
        """The options the core runs with: it queues `_Item`s, collates them into a
        `SessionBatch`, and takes `batch_function`'s list of results as they are."""
        return dataclasses.replace(options, collate=self._collate, split=None)

    def bind(self, core: ServingCore) -> None:
        """Serve through `core` (made from `core_options`)."""
        self.core = core

    # -- the batch function ------------------------------------------------------
    def _collate(self, items: list[_Item]) -> SessionBatch:
        chunks = [item.chunk for item in items]
        return SessionBatch(items, self.collate(chunks) if self.collate is not None else chunks)

    def _gather(self, batch: SessionBatch) -> Any:
        slots = [item.session.slot for item in batch.items]  # type: ignore[union-attr]
        with self.lock:
            return self.store.gather(slots)

    def _call(self, batch: SessionBatch) -> list[Any]:
        states = self._gather(batch)
        return self._commit(batch, states, self.fn(batch.argument, states))

    async def _call_async(self, batch: SessionBatch) -> list[Any]:
        states = self._gather(batch)
        return self._commit(batch, states, await self.fn(batch.argument, states))

    def _commit(self, batch: SessionBatch, states: Any, output: Any) -> list[Any]:
        """Check `fn`'s output, write the new states of the items that succeeded, and
        return the per-item results (an exception result fails its item alone)."""
        name = self.name
        if not (isinstance(output, (tuple, list)) and len(output) == 2):
            raise TypeError(
                f"{name} keeps sessions (state=), so it must return a pair "
                f"(results, new_states), got {type(output).__name__}"
            )
        results, new_states = output
        count = len(batch.items)  # (with a strict size's padding)
        if self.split is not None:  # (the user's split makes the per-item results)
            results = results_per_item(self.split(results), None, count, name)
        else:
            results = results_per_item(results, layout_of(batch.argument), count, name)
        results = list(itertools.islice(results, count))
        if len(results) != count:  # len() said otherwise: e.g. a table iterating columns
            raise ValueError(f"{name} returned {len(results)} results for a batch of {count}")
        self.store.check(new_states, count, name)
        slots: list[int] = []
        rows: list[int] = []
        seen: set[int] = set()
        with self.lock:
            for i, item in enumerate(batch.items):
                # A padding copy repeats an item; a settled one was answered already
                # (a timed-out batch's late return, a close): neither writes.
                if id(item) in seen or item.settled or isinstance(results[i], BaseException):
                    continue
                seen.add(id(item))
                item.previous = self.store.row(states, i)
                item.committed = True
                slots.append(item.session.slot)  # type: ignore[union-attr]
                rows.append(i)
            if slots:
                self.store.commit(slots, rows, new_states)
        return results

    # -- callers --------------------------------------------------------------------
    def call(
        self, chunk: Any, key: Hashable, end: bool, priority: int, timeout: float | None
    ) -> Any:
        """One chunk of session `key` from a thread: block until its result.

        Raises:
            RequestTimeout: It did not start within `timeout` (it never ran).
            TooManySessions: It would start a session past `max_sessions`.
        """
        timeout = checked_timeout(timeout)
        core = self._core()
        started = core.clock() if timeout is not None else 0.0
        req = self._enqueue(chunk, key, end, priority, None)
        left = self._until_room_check(timeout, started)
        while not req.wait(left):
            if timeout is not None and core.clock() - started >= timeout:
                if self._withdraw(req, core.answers.timeout_error(timeout), timed_out=True):
                    raise own_error(req.error)  # type: ignore[arg-type]
                req.wait(None)  # it started: its result is on the way
                break
            self._sweep()  # (waiting for room: idle sessions may have expired)
            left = self._until_room_check(timeout, started)
        return req.outcome()

    async def acall(
        self, chunk: Any, key: Hashable, end: bool, priority: int, timeout: float | None
    ) -> Any:
        """`call` from asyncio: the same, and a cancelled caller's request is
        withdrawn (or, already running, its new state is not kept)."""
        timeout = checked_timeout(timeout)
        core = self._core()
        loop = asyncio.get_running_loop()
        started = core.clock() if timeout is not None else 0.0
        req = self._enqueue(chunk, key, end, priority, loop)
        future = req.future
        assert future is not None
        try:
            while True:
                left = self._until_room_check(timeout, started)
                if left is None:
                    return await future
                try:
                    return await asyncio.wait_for(asyncio.shield(future), left)
                except asyncio.TimeoutError:  # (not TimeoutError before Python 3.11)
                    if timeout is not None and core.clock() - started >= timeout:
                        if self._withdraw(req, core.answers.timeout_error(timeout), timed_out=True):
                            raise req.error from None  # type: ignore[misc]
                        return await future  # it started: its result is on the way
                    self._sweep()
        except asyncio.CancelledError:
            self._withdraw(req, asyncio.CancelledError(), timed_out=False)
            raise

    def _until_room_check(self, timeout: float | None, started: float) -> float | None:
        """How long a caller waits before looking again: its timeout's rest, or, while
        sessions wait for room and idle sessions may expire, until the next expiry."""
        left = None if timeout is None else max(timeout - (self._core().clock() - started), 0.0)
        idle = self.settings.idle_s
        if idle is None or not self.waiting_for_room:
            return left
        with self.lock:
            oldest = next((s for s in self.sessions.values() if not s.busy), None)
            if oldest is None:
                return left
            until = max(oldest.last_used + idle - self.clock(), 0.0) + 1e-3
        return until if left is None else min(left, until)

    def _core(self) -> ServingCore:
        core = self.core
        assert core is not None, "Sessions.bind was not called"
        return core

    def _enqueue(
        self,
        chunk: Any,
        key: Hashable,
        end: bool,
        priority: int,
        loop: asyncio.AbstractEventLoop | None,
    ) -> Request:
        """Make the request, queue it behind its session's, and submit it if it is the
        session's head. `init` runs here, in the caller, outside the lock."""
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"session key must be hashable, got {type(key).__name__}") from None
        if not isinstance(end, bool):
            raise TypeError(f"end must be True or False, got {type(end).__name__}")
        core = self._core()
        req = core.make_request(chunk, priority, loop)  # (key and group see the chunk)
        with core.lock:  # here, on the caller's thread (see `_submit`)
            core.driver.check_loop_locked(loop)
        item = _Item(chunk, end)
        req.item = item
        req.on_settled = self._settled
        first_state: Any = _UNSET
        while True:
            with self.lock:
                if self.closed:
                    raise BatcherClosed(f"{self.name} is closed")
                now = self.clock()
                self._sweep_locked(now)
                session = self.sessions.get(key)
                starts = session is None or session.ends_with_last
                if not starts or first_state is not _UNSET:
                    start_with = first_state if starts else _UNSET
                    submit = self._place_locked(req, key, session, start_with, now)
                    break
            first_state = self._first_state(key)  # user code: outside the lock
        for head in submit:
            self._submit(head)
        return req

    def _first_state(self, key: Hashable) -> Any:
        init = self.settings.init
        return init(key) if self.settings.init_takes_key else init()

    def _place_locked(
        self,
        req: Request,
        key: Hashable,
        session: _Session | None,
        first_state: Any,
        now: float,
    ) -> list[Request]:
        """Queue `req` in its session (a new one if needed); return what to submit."""
        item: _Item = req.item
        limit = self.settings.max_sessions
        if session is None:
            session = _Session(key, now)
            if limit is not None and self.live >= limit:
                if self.settings.when_full == "reject":
                    raise TooManySessions(
                        f"{self.name}: max_sessions={limit} sessions are live; session "
                        f"{key!r} was not started (end a session, or use "
                        'when_sessions_full="block" to wait for room)'
                    )
                session.first_state = first_state
                self.waiting_for_room.append(session)
            else:
                session.slot = self.store.add(first_state)
                self.live += 1
            self.sessions[key] = session
        else:
            if first_state is not _UNSET:  # after an end: the session starts over
                item.first_state = first_state
            self.sessions.move_to_end(key)
            session.last_used = now
        item.session = session
        session.ends_with_last = item.end
        if session.waiting_for_room or session.head is not None:
            session.queue.append(req)
            return []
        if item.first_state is not _UNSET:  # (an ended session left idle: start over now)
            self.store.put(session.slot, item.first_state)
            item.first_state = _UNSET
        session.head = req
        return [req]

    def _submit(self, req: Request) -> None:
        """Submit a session's head; one the core refuses (closed, full) is answered
        with that error, and the session's next request goes in its place."""
        pending = [req]
        while pending:
            head = pending.pop()
            try:
                # (Checked when it was made: it may go in from another thread.)
                self._core().submit(head, loop_checked=True)
            except BaseException as exc:  # noqa: BLE001 - its caller gets it
                head.error = exc
                with self.lock:
                    pending += self._advance_locked(head)
                deliver([head])  # (the hook finds it settled: it only wakes the caller)

    def _settled(self, requests: Sequence[Request]) -> None:
        """The core's hook: `requests` have their outcomes; their sessions' next
        requests go in, together (one admission for a batch's worth)."""
        with self.lock:
            heads = [head for req in requests for head in self._advance_locked(req)]
        if not heads:
            return
        try:
            self._core().submit_many(heads, loop_checked=True)
        except BaseException:  # noqa: BLE001 - one at a time: each gets its own answer
            for head in heads:
                self._submit(head)

    def _advance_locked(self, req: Request) -> list[Request]:
        """`req` settled: put its session's state back if it failed, end the session
        if it asked to; return the requests to submit next (none if seen before)."""
        item: _Item = req.item
        if item.settled:
            return []
        item.settled = True
        session = item.session
        assert session is not None
        failed = req.error is not None or item.cancelled
        if item.committed and failed:
            self.store.put(session.slot, item.previous)  # the state before it
        item.previous = _UNSET
        if session.head is req:
            session.head = None
            session.last_used = self.clock()
            if self.sessions.get(session.key) is session:
                self.sessions.move_to_end(session.key)
        return self._next_heads_locked(session, item.end)

    def _next_heads_locked(self, session: _Session, ended: bool) -> list[Request]:
        """The session's head settled (ending it if `ended`): its next request, or
        none; requests withdrawn while queued are passed over (their `end` counts)."""
        queue = session.queue
        while True:
            if ended and not queue:
                return self._end_locked(session, evicted=False)
            if ended:  # it starts over, with its next request's first state
                self.ended += 1
            if not queue:
                return []
            nxt = queue.popleft()
            item: _Item = nxt.item
            if item.first_state is not _UNSET:
                self.store.put(session.slot, item.first_state)
                item.first_state = _UNSET
            if item.withdrawn:
                ended = item.end
                continue
            session.head = nxt
            return [nxt]

    def _end_locked(self, session: _Session, *, evicted: bool) -> list[Request]:
        """Free a session with nothing queued; return the heads of sessions that got
        its room."""
        del self.sessions[session.key]
        self.store.remove(session.slot)
        session.slot = -1
        self.live -= 1
        if evicted:
            self.evicted += 1
        else:
            self.ended += 1
        return self._admit_waiting_locked()

    def _admit_waiting_locked(self) -> list[Request]:
        limit = self.settings.max_sessions
        heads: list[Request] = []
        while self.waiting_for_room and (limit is None or self.live < limit):
            session = self.waiting_for_room.popleft()
            session.slot = self.store.add(session.first_state)
            session.first_state = _UNSET
            self.live += 1
            heads += self._next_heads_locked(session, ended=False)
        return heads

    def _withdraw(self, req: Request, error: BaseException, *, timed_out: bool) -> bool:
        """Take back a request whose caller stopped waiting (timeout, cancellation).

        Returns:
            True if it will not run (its error is set); False if it runs on (a
            cancelled caller's new state is then not kept).
        """
        core = self._core()
        with self.lock:
            item: _Item = req.item
            if item.settled:
                return False
            if not timed_out:
                item.cancelled = True
            session = item.session
            assert session is not None
            if session.head is not req:  # queued here: pass it over at its turn
                item.withdrawn = item.settled = True
                req.error = error  # (its caller raises it, or `close` delivers it)
                if session.waiting_for_room and not any(
                    not r.item.withdrawn for r in session.queue
                ):
                    self._forget_waiting_locked(session)
                return True
        return core.give_up(req, error, timed_out=timed_out)  # its hook advances

    def _forget_waiting_locked(self, session: _Session) -> None:
        """A session waiting for room whose every request was withdrawn: it never
        starts."""
        self.waiting_for_room.remove(session)
        if self.sessions.get(session.key) is session:
            del self.sessions[session.key]

    # -- lifetime -----------------------------------------------------------------
    def end_session(self, key: Hashable) -> bool:
        """End session `key` once its queued requests have settled (now, if none).

        Returns:
            True if there was such a session (live, or waiting for room).
        """
        with self.lock:
            session = self.sessions.get(key)
            if session is None or session.ends_with_last:
                return session is not None
            session.ends_with_last = True
            if session.queue:
                session.queue[-1].item.end = True
                return True
            if session.head is not None:
                session.head.item.end = True
                return True
            heads = self._end_locked(session, evicted=False)
        for head in heads:
            self._submit(head)
        return True

    def _sweep(self) -> None:
        with self.lock:
            heads = self._sweep_locked(self.clock())
        for head in heads:
            self._submit(head)

    def _sweep_locked(self, now: float) -> list[Request]:
        """End the sessions idle for `session_idle_s`; return heads that got room."""
        idle = self.settings.idle_s
        if idle is None:
            return []
        expired = []
        for session in self.sessions.values():
            if session.last_used + idle > now:
                break  # (least recently used first: the rest are newer)
            if not session.busy and not session.waiting_for_room:
                expired.append(session)
        heads: list[Request] = []
        for session in expired:
            heads += self._end_locked(session, evicted=True)
        return heads

    def counts(self) -> tuple[int, int, int]:
        """`(live sessions, sessions ended, sessions evicted as idle)` now, after
        ending the sessions that are idle past `session_idle_s`."""
        self._sweep()
        with self.lock:
            return self.live, self.ended, self.evicted

    def close(self) -> None:
        """Accept no new request; fail those waiting here (queued behind a head, or
        for room) with `BatcherClosed`. Heads already in the core are served."""
        error = BatcherClosed(f"{self.name} closed before this request was queued")
        with self.lock:
            self.closed = True
            waiting = [r for s in self.sessions.values() for r in s.queue if not r.item.withdrawn]
        for req in waiting:
            if self._withdraw(req, error, timed_out=False):
                deliver([req])

    def state_of(self, key: Hashable) -> Any:
        """Session `key`'s current state (a copy of its row, for stacked states).

        Raises:
            KeyError: No live session has that key.
        """
        with self.lock:
            session = self.sessions.get(key)
            if session is None or session.waiting_for_room:
                raise KeyError(key)
            return self.store.row(self.store.gather([session.slot]), 0)
