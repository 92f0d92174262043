"""`@batched`: call a batch function one item at a time, from threads or asyncio."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import pickle
import sys
import threading
import time
import warnings
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Iterator,
    MutableMapping,
    Sequence,
)
from typing import Any, Generic, Literal, Protocol, cast

# TypeVar's default= before Python 3.13; overload's registry (get_overloads) on 3.10.
from typing_extensions import Never, Self, TypeVar, overload

from batchkit.batchers.base import Batcher
from batchkit.collate.inverse import PerToken
from batchkit.collate.shapes import ShapeBuckets
from batchkit.serve import callers
from batchkit.serve.events import Listener
from batchkit.serve.layers import Driver, build_layers
from batchkit.serve.options import (
    Clock,
    OnOom,
    Options,
    Settings,
    SettingsChange,
    check_serving_options,
    collate_and_policy,
    oom_recovery,
    policy_of,
    session_options,
)
from batchkit.serve.sessions import Sessions
from batchkit.serve.stats import Stats

# A batched function's types: what one caller passes (an item of the function's list),
# what it gets back (an entry of the returned sequence; a chunk, for a stream), and what
# `f(item)` itself returns (the result; an awaitable of it for an async function).
ItemT_contra = TypeVar("ItemT_contra", contravariant=True)
ResultT_co = TypeVar("ResultT_co", covariant=True)
CallT_co = TypeVar("CallT_co", covariant=True, default=ResultT_co)
# The same, as `batched` reads them off the function it decorates.
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class BatchedFunction(Generic[ItemT_contra, ResultT_co, CallT_co]):
    """A batch function wrapped so that callers pass one item and get one result.

    Made by [`batched`][batchkit.serve.batched.batched], not constructed directly.
    Sync functions: `f(x)` blocks the calling thread; async functions: `f(x)`
    returns an awaitable. `await f.acall(x)` works for both (a sync function then
    runs on a worker thread, never on the loop). A generator function is read with
    [`stream`][batchkit.BatchedFunction.stream] or
    [`astream`][batchkit.BatchedFunction.astream] instead.

    Every call takes `priority` (an `int`: lower values are served first, then
    arrival order; default 0) and `timeout` (seconds the item may wait before its
    batch starts, else [`RequestTimeout`][batchkit.RequestTimeout]; None, the
    default, or `math.inf` waits as long as it takes; with `when_full="block"` the
    wait for queue room counts too; NaN, a negative number or a non-number is refused
    before anything is queued). Once its batch has started, an item is no longer
    bounded by `timeout` (`batch_timeout` bounds the call).

    A batched function defined at module level pickles by reference to its name (as
    a function does), so `multiprocessing` can send it; a process that unpickles it
    uses its own. After `os.fork()` the child starts its own workers.

    It is also a context manager (`with`, `async with`) that closes it on exit.

    Type parameters: `BatchedFunction[Item, Result]` takes an `Item` per call and
    gives a `Result` (for a stream, a chunk); the third, what `f(item)` returns, is
    `Result` for a sync function (the default), `Coroutine[Any, Any, Result]` for an
    async one, and `Never` for a stream (`f(item)` raises: read it with `stream`).
    [`batched`][batchkit.serve.batched.batched] reads them off the function's
    annotations.
    """

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        # No Args section on purpose: batched() makes it (from the function and its
        # validated Options), and the reference hides this signature.
        self.fn = fn
        call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        self.streams = any(
            inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call)
        )
        self.is_async = any(
            inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call)
        )
        self.options = options = dataclasses.replace(options, streaming=self.streams)
        self.__name__ = getattr(fn, "__name__", "batched")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn
        self._bind_lock = threading.RLock()
        self._bound_by_instance: weakref.WeakKeyDictionary[
            Any, BatchedFunction[ItemT_contra, ResultT_co, CallT_co]
        ] = weakref.WeakKeyDictionary()
        # Created now (cheap: no thread starts before the first call).
        self._layers = build_layers(fn, options, self.__qualname__, is_async=self.is_async)
        self._warned_on_loop = False
        # Dropped (a function made at run time, an instance's method with its
        # instance), it closes: its workers exit, and the function they hold is
        # freed. Nothing the driver holds refers back to this wrapper.
        weakref.finalize(self, self._layers.driver.close_nowait).atexit = False

    @property
    def runtime(self) -> Driver:
        """The driver behind this function: its workers, and its queue (`runtime.core`)."""
        return self._layers.driver

    # -- methods: one queue per instance --------------------------------------
    def __set_name__(self, owner: type, name: str) -> None:
        self._attr_name = name

    def __get__(
        self, instance: object, owner: type | None = None
    ) -> BatchedFunction[ItemT_contra, ResultT_co, CallT_co]:
        if instance is None:
            return self
        with self._bind_lock:  # two threads' first access must share one queue
            return self._bound_for(instance, owner)

    def _bound_for(
        self, instance: Any, owner: type | None
    ) -> BatchedFunction[ItemT_contra, ResultT_co, CallT_co]:
        name = getattr(self, "_attr_name", None)
        if name is not None and isinstance(getattr(instance, "__dict__", None), dict):
            cached: BatchedFunction[ItemT_contra, ResultT_co, CallT_co] | None
            cached = instance.__dict__.get(name)
            if cached is None:
                cached = BatchedFunction(self.fn.__get__(instance, owner), self.options)
                instance.__dict__[name] = cached  # later lookups skip this descriptor
            return cached
        try:  # __slots__ classes: remember the instance weakly
            bound = self._bound_by_instance.get(instance)
            if bound is None:
                bound = BatchedFunction(self.fn.__get__(instance, owner), self.options)
                self._bound_by_instance[instance] = bound
            return bound
        except TypeError:
            raise TypeError(
                f"@batched method {self.__qualname__} needs one queue per instance: give "
                f"{type(instance).__name__} a __dict__ or '__weakref__' in its __slots__"
            ) from None

    # -- one item ------------------------------------------------------------
    def __call__(
        self,
        item: ItemT_contra,
        *,
        priority: int = 0,
        timeout: float | None = None,
        session: Hashable | None = None,
        end: bool = False,
    ) -> CallT_co:
        """Run one item in a batch: `f(x)`, or `f(chunk, session=key)` for a stateful
        function (`state=`).

        A sync function blocks this thread until the result (called on a thread that
        runs an event loop, it warns once: nothing batches while the loop is
        blocked; use [`acall`][batchkit.BatchedFunction.acall] there). An async
        function returns an awaitable of the result.

        Args:
            item: The item; the policy's key (if any) is computed here, so its errors
                reach this caller.
            priority: Lower values are served first (then arrival order); an `int`.
            timeout: Seconds the item may wait before its batch starts; None (the
                default) for no bound. For a session's request the wait behind its
                session's earlier requests counts too.
            session: A stateful function's session key (any hashable but None): the
                request runs after the session's earlier ones, with its state.
            end: The session ends once this request has settled (its state is freed;
                a later call with the key starts a new session).

        Returns:
            The item's result (sync), or an awaitable of it (async).

        Raises:
            RequestTimeout: The item did not start within `timeout`; it will not run.
            QueueFull: `max_queue_size` requests wait (with `when_full="reject"`).
            BatcherClosed: The function is closed, or closed before serving the item.
            BatchTimeout: The item's batch ran past `batch_timeout`.
            TypeError: The function is a generator function (use `stream`),
                `priority` is not an `int`, `timeout` is not a number, `session` is
                missing for a stateful function (or given to a stateless one), or
                not hashable.
            TooManySessions: It would start a session past `max_sessions`.
            ValueError: `timeout` is NaN or negative; nothing was queued.
            BatchInterrupted: The batch function raised `SystemExit` or
                `KeyboardInterrupt` (its `__cause__`) on its worker thread.
            Exception: Whatever the batch function raised for this item.
        """
        if self.streams:
            raise streams_error(self.__name__, is_async=self.is_async)
        if self._layers.sessions is not None or session is not None or end:
            sessions = session_layer(self._layers.sessions, self.__name__, session)
            if self.is_async:
                return cast(CallT_co, sessions.acall(item, session, end, priority, timeout))
            if not self._warned_on_loop and asyncio._get_running_loop() is not None:
                self._warn_blocking_on_loop()
            answer: CallT_co = sessions.call(item, session, end, priority, timeout)
            return answer
        if self.is_async:
            return cast(CallT_co, callers.acall(self._layers.front, item, priority, timeout))
        if not self._warned_on_loop and asyncio._get_running_loop() is not None:
            self._warn_blocking_on_loop()
        result: CallT_co = callers.call(self._layers.front, item, priority, timeout)
        return result

    def _warn_blocking_on_loop(self) -> None:
        self._warned_on_loop = True
        name = self.__name__
        warnings.warn(
            f"{name}(x) blocks this thread, which is running an event loop: nothing else "
            f"on the loop runs meanwhile, so its calls cannot batch together (batches of "
            f"one). Use 'await {name}.acall(x)' from asyncio.",
            RuntimeWarning,
            stacklevel=3,
        )

    async def acall(
        self,
        item: ItemT_contra,
        *,
        priority: int = 0,
        timeout: float | None = None,
        session: Hashable | None = None,
        end: bool = False,
    ) -> ResultT_co:
        """Run one item in a batch, from asyncio (sync or async function alike).

        A sync function runs on a worker thread: the loop is never blocked.
        Cancelling the awaiting task withdraws the item if it has not started (a
        session's request cancelled while it runs does not advance its session).

        Args:
            item: The item.
            priority: Lower values are served first (then arrival order); an `int`.
            timeout: Seconds the item may wait before its batch starts, else
                [`RequestTimeout`][batchkit.RequestTimeout]; None (the default) for
                no bound.
            session: A stateful function's session key (see `__call__`).
            end: The session ends once this request has settled.

        Returns:
            The item's result.

        Raises:
            RequestTimeout: The item did not start within `timeout`.
            TooManySessions: It would start a session past `max_sessions`.
            QueueFull: `max_queue_size` requests wait (with `when_full="reject"`).
            BatcherClosed: The function is closed, or closed before serving the item.
            BatchTimeout: The item's batch ran past `batch_timeout`.
            RuntimeError: An async function already serves another running event
                loop (it serves one loop at a time).
            TypeError: The function is a generator function (use `astream`), or
                `timeout` is not a number.
            ValueError: `timeout` is NaN or negative; nothing was queued.
            BatchInterrupted: A sync batch function raised `SystemExit` or
                `KeyboardInterrupt` (its `__cause__`) on its worker thread.
        """
        if self.streams:
            raise streams_error(self.__name__, is_async=self.is_async)
        if self._layers.sessions is not None or session is not None or end:
            stateful = session_layer(self._layers.sessions, self.__name__, session)
            answer: ResultT_co = await stateful.acall(item, session, end, priority, timeout)
            return answer
        result: ResultT_co = await callers.acall(self._layers.front, item, priority, timeout)
        return result

    # -- streams ----------------------------------------------------------------
    def stream(
        self, item: ItemT_contra, *, priority: int = 0, timeout: float | None = None
    ) -> Iterator[ResultT_co]:
        """One item's chunks, from a thread, as the batch's generator yields them.

        For a sync generator function. The item is queued at once, when the iterator
        is made (so streams made one after another batch together). Stopping early
        (`break`, `close()`, dropping the iterator) drops the rest of this stream
        only; once every caller of a batch has left, its generator is closed.

        Args:
            item: The item.
            priority: Lower values are served first (then arrival order); an `int`.
            timeout: Seconds the item may wait before its batch starts (its first
                chunk is then on the way; later chunks are not bounded); None (the
                default) for no bound.

        Returns:
            An iterator of the item's chunks. It ends when the generator yields
            [`END`][batchkit.END] for the item or returns; it raises the exception
            the generator yielded for the item or raised, and
            [`RequestTimeout`][batchkit.RequestTimeout] if the batch did not start
            within `timeout`.

        Raises:
            QueueFull: `max_queue_size` requests wait (with `when_full="reject"`).
            RequestTimeout: With `when_full="block"`, no room was free within
                `timeout`.
            BatcherClosed: The function is closed.
            TypeError: The function is not a generator function, or is an async one
                (use `astream`), or `timeout` is not a number.
            ValueError: `timeout` is NaN or negative; nothing was queued.
        """
        if not self.streams:
            raise plain_error(self.__name__, "stream", is_async=self.is_async)
        if self.is_async:
            raise TypeError(
                f"{self.__name__} is an async generator function: use '{self.__name__}.astream(x)'"
            )
        return callers.ThreadStream(self._layers.core, item, priority, timeout)

    def astream(
        self, item: ItemT_contra, *, priority: int = 0, timeout: float | None = None
    ) -> AsyncIterator[ResultT_co]:
        """One item's chunks, from asyncio (sync or async generator function alike).

        Call it inside a coroutine; a sync generator runs on a worker thread and its
        chunks reach this loop without blocking it. `aclose()`, `break` or a
        cancelled task leaves the stream (see
        [`stream`][batchkit.BatchedFunction.stream]).

        Args:
            item: The item.
            priority: Lower values are served first (then arrival order); an `int`.
            timeout: Seconds the item may wait before its batch starts (later chunks
                are not bounded); None (the default) for no bound.

        Returns:
            An async iterator of the item's chunks, ending and raising as
            [`stream`][batchkit.BatchedFunction.stream]'s does. The item is queued at
            once, or, with `when_full="block"`, at the first `__anext__` (which may
            wait for room).

        Raises:
            QueueFull: `max_queue_size` requests wait (with `when_full="reject"`).
            BatcherClosed: The function is closed.
            RuntimeError: No event loop is running in this thread.
            TypeError: The function is not a generator function, or `timeout` is not
                a number.
            ValueError: `timeout` is NaN or negative; nothing was queued.
        """
        if not self.streams:
            raise plain_error(self.__name__, "astream", is_async=self.is_async)
        return callers.LoopStream(self._layers.core, item, priority, timeout)

    # -- many items ------------------------------------------------------------
    def map(
        self, items: Iterable[ItemT_contra], *, priority: int = 0, timeout: float | None = None
    ) -> list[ResultT_co]:
        """Run many items from a thread; results in input order.

        For a sync function. The items are queued together (they batch with each
        other and with other callers' items); this returns, or raises, once every
        item has finished.

        Args:
            items: The items.
            priority: Every item's priority: lower values are served first.
            timeout: Seconds, counted from this call, within which each item must
                have started; at the deadline the items not yet started are withdrawn
                with [`RequestTimeout`][batchkit.RequestTimeout]. None (the default)
                for no bound.

        Returns:
            One result per item, in input order.

        Raises:
            QueueFull: The items do not all fit in the queue (`max_queue_size`, with
                `when_full="reject"`): none of them was queued.
            BatcherClosed: The function is closed.
            TypeError: The function is async (use `amap`), a generator function or
                a stateful one (`state=`: call it per chunk), or `timeout` is not a
                number.
            ValueError: `timeout` is NaN or negative; nothing was queued.
            Exception: The first failed item's error, in input order.
        """
        if self.streams:
            raise streams_error(self.__name__, is_async=self.is_async)
        if self._layers.sessions is not None:
            raise sessions_map_error(self.__name__)
        if self.is_async:
            raise TypeError(f"{self.__name__} is async: use 'await {self.__name__}.amap(items)'")
        return callers.call_many(self._layers.front, items, priority, timeout)

    async def amap(
        self, items: Iterable[ItemT_contra], *, priority: int = 0, timeout: float | None = None
    ) -> list[ResultT_co]:
        """Run many items from asyncio, for sync and async functions; results in input
        order.

        Args:
            items: The items.
            priority: Every item's priority: lower values are served first.
            timeout: Seconds, counted from this call, within which each item must
                have started (else [`RequestTimeout`][batchkit.RequestTimeout] for
                it); None (the default) for no bound.

        Returns:
            One result per item, in input order.

        Raises:
            QueueFull: The items do not all fit in the queue (`max_queue_size`, with
                `when_full="reject"`): none of them was queued.
            BatcherClosed: The function is closed.
            TypeError: The function is a generator function or a stateful one
                (`state=`), or `timeout` is not a number.
            ValueError: `timeout` is NaN or negative; nothing was queued.
            Exception: The first failed item's error, in input order, once every
                item has finished.
        """
        if self.streams:
            raise streams_error(self.__name__, is_async=self.is_async)
        if self._layers.sessions is not None:
            raise sessions_map_error(self.__name__)
        return await callers.amap(self._layers.front, items, priority, timeout)

    # -- sessions ------------------------------------------------------------------
    def end_session(self, key: Hashable) -> bool:
        """End session `key` of a stateful function (`state=`): its state is freed once
        the requests it already has have settled (at once if it has none). A later
        call with `key` starts a new session.

        Args:
            key: The session's key.

        Returns:
            True if such a session was live (or waiting for room); False otherwise.

        Raises:
            TypeError: The function keeps no sessions.
        """
        if self._layers.sessions is None:
            raise TypeError(f"{self.__name__} keeps no sessions: end_session needs state=")
        return self._layers.sessions.end_session(key)

    def session_state(self, key: Hashable) -> Any:
        """Session `key`'s current state, as the batch function last returned it (a
        copy of its row with `stack_states=True`); its next request starts from it.

        Args:
            key: The session's key.

        Raises:
            KeyError: No live session has that key.
            TypeError: The function keeps no sessions.
        """
        if self._layers.sessions is None:
            raise TypeError(f"{self.__name__} keeps no sessions: session_state needs state=")
        return self._layers.sessions.state_of(key)

    def session_counts(self) -> tuple[int, int, int]:
        """`(live, ended, evicted)` sessions now, as `stats` reports them, without its
        percentiles (what a metrics scrape reads); `(0, 0, 0)` without `state=`. Ends
        the sessions idle past `session_idle_s` first."""
        return (0, 0, 0) if self._layers.sessions is None else self._layers.sessions.counts()

    # -- introspection and lifetime ---------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Observe every batch that ends and every request dropped without running.

        Args:
            listener: A [`Listener`][batchkit.serve.Listener]: its `on_batch` gets a
                [`BatchEvent`][batchkit.serve.BatchEvent], its `on_drop` a
                [`DropEvent`][batchkit.serve.DropEvent]. Both are called on the
                worker thread (or event loop) right after the fact, under the
                function's lock: keep them fast and non-blocking. An exception they
                raise is logged, never passed on.
        """
        self._layers.core.answers.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop observing.

        Args:
            listener: A listener given to
                [`add_listener`][batchkit.BatchedFunction.add_listener] (compared by
                identity; one not added is ignored).
        """
        self._layers.core.answers.remove_listener(listener)

    def stats(self) -> Stats:
        """A snapshot of the counters and latencies since the function was made.

        Returns:
            A [`Stats`][batchkit.Stats]: requests, batches, batch sizes, waits,
            latencies, dispatch reasons, and the health of the workers.
        """
        stats = self._layers.core.readings.stats()
        if self._layers.sessions is None:
            return stats
        live, ended, evicted = self._layers.sessions.counts()
        return dataclasses.replace(
            stats, sessions=live, sessions_ended=ended, sessions_evicted=evicted
        )

    def cache_clear(self) -> None:
        """Empty the result cache given as `cache=` (results still being computed
        are stored when they arrive). The mapping's own API works as well.

        Raises:
            TypeError: The function has no cache, or its mapping has no `clear()`.
        """
        if self._layers.coalescer is None:
            raise TypeError(f"{self.__name__} has no cache to clear (see @batched(cache=...))")
        self._layers.coalescer.cache_clear()

    def configure(
        self,
        *,
        max_batch_size: int | None = None,
        max_wait_ms: float | None = None,
        max_concurrent_batches: int | None = None,
        max_queue_size: int | None = None,
        max_latency_ms: float | None = None,
    ) -> Settings:
        """Change settings while serving; with no argument, read them.

        What is given changes at once, atomically, for batches formed from then on (a
        running batch is not touched; a larger size or concurrency wakes the scheduler
        at once). Thread-safe under load: nothing queued is lost or run twice.

        Args:
            max_batch_size: The policy's largest batch, in items (at most the largest
                of a policy's `preferred_batch_sizes`).
            max_wait_ms: The policy's longest wait for a batch to fill, in
                milliseconds (>= 0); a policy without one
                ([`StaticBatcher`][batchkit.StaticBatcher]) refuses it by name.
            max_concurrent_batches: Batches that may run at once.
            max_queue_size: Requests that may wait. A bound can be set or changed,
                not removed; requests already waiting past a lower bound stay.
            max_latency_ms: Each request's latency target (see `@batched`), also
                for the requests already waiting (counted from their admission). It
                can be set or changed, not removed; the learned model is kept.

        Returns:
            The settings in force afterwards.

        Raises:
            TypeError: A value has the wrong type (a string or a bool for a
                number); nothing was changed.
            ValueError: A value is out of range (a wait or target longer than the
                platform's timers take among them), or the policy has no such
                setting; nothing was changed.
        """
        changes = SettingsChange(
            max_batch_size, max_wait_ms, max_concurrent_batches, max_queue_size, max_latency_ms
        )
        return self._layers.core.configure(changes)

    def load(self) -> tuple[int, int]:
        """`(queue depth, batches in flight)` now, cheaply (what a metrics scrape reads)."""
        return self._layers.core.readings.load()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, serve what is queued and running, and wait for it.

        Later calls raise [`BatcherClosed`][batchkit.BatcherClosed]. Waiting requests
        leave at once, without waiting for a full batch or the max wait. For an async
        function, call it from another thread than the loop's (inside the loop, use
        [`aclose`][batchkit.BatchedFunction.aclose]); when its loop no longer runs,
        whatever is left fails at once with `BatcherClosed`.

        Args:
            timeout: Seconds to wait; then every request not answered yet, waiting or
                running, fails with [`BatcherClosed`][batchkit.BatcherClosed] (a
                running batch goes on, its results discarded). None (the default)
                waits for everything.

        Raises:
            RuntimeError: An async function's `close` was called on its own loop.
        """
        self._layers.close(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """[`close`][batchkit.BatchedFunction.close] from asyncio, without blocking the
        loop.

        Args:
            timeout: Seconds to wait before failing what is left with
                [`BatcherClosed`][batchkit.BatcherClosed]; None (the default) waits
                for everything.

        Raises:
            RuntimeError: An async function is closed from another loop than the one
                it serves.
        """
        await self._layers.aclose(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<batched {self.__qualname__} {self.options.policy!r}>"

    def __reduce__(self) -> str:
        """Pickled by reference to its module-level name, as a function is: the
        receiving process (a `multiprocessing` worker, say) imports the module and
        gets its own batched function there, with its own queue and workers.

        Raises:
            pickle.PicklingError: It is not reachable by its name in its module (one
                made inside a function, or a method's per-instance function).
        """
        module_name = getattr(self.fn, "__module__", None) or "__main__"
        qualname: str = self.__qualname__
        found: Any = sys.modules.get(module_name)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is not self:
            raise pickle.PicklingError(
                f"cannot pickle batched function {qualname!r}: it is pickled by "
                f"reference to its module-level name, and {module_name}.{qualname} "
                "is not it. Define it with @batched at module level, or send the items "
                "and call it in the receiving process"
            )
        return qualname


class BatchedDecorator(Protocol):
    """What `@batched(...)` returns when neither `collate` nor `split` is given: a
    decorator that types the function it wraps as bare `@batched` does."""

    @overload
    def __call__(
        self, fn: Callable[[list[ItemT]], Sequence[ResultT]], /
    ) -> BatchedFunction[ItemT, ResultT]: ...
    @overload
    def __call__(
        self, fn: Callable[[list[ItemT]], Awaitable[Sequence[ResultT]]], /
    ) -> BatchedFunction[ItemT, ResultT, Coroutine[Any, Any, ResultT]]: ...
    @overload
    def __call__(
        self,
        fn: Callable[[list[ItemT]], Iterator[Sequence[ResultT]] | AsyncIterator[Sequence[ResultT]]],
        /,
    ) -> BatchedFunction[ItemT, ResultT, Never]: ...
    @overload
    def __call__(
        self, fn: Callable[[list[ItemT]], object], /
    ) -> BatchedFunction[ItemT, Any, Any]: ...
    @overload
    def __call__(
        self, fn: Callable[[Any, list[ItemT]], Sequence[ResultT]], /
    ) -> BatchedFunction[ItemT, ResultT]: ...
    @overload
    def __call__(
        self, fn: Callable[[Any, list[ItemT]], Awaitable[Sequence[ResultT]]], /
    ) -> BatchedFunction[ItemT, ResultT, Coroutine[Any, Any, ResultT]]: ...
    @overload
    def __call__(
        self,
        fn: Callable[
            [Any, list[ItemT]], Iterator[Sequence[ResultT]] | AsyncIterator[Sequence[ResultT]]
        ],
        /,
    ) -> BatchedFunction[ItemT, ResultT, Never]: ...
    @overload
    def __call__(
        self, fn: Callable[[Any, list[ItemT]], object], /
    ) -> BatchedFunction[ItemT, Any, Any]: ...
    @overload
    def __call__(self, fn: Callable[..., Any], /) -> BatchedFunction[Any, Any, Any]: ...
    def __call__(self, fn: Callable[..., Any], /) -> BatchedFunction[Any, Any, Any]:
        """Wrap `fn` with the options given to `batched`.

        Args:
            fn: The batch function.
        """
        ...


# The types of a function's callers come from its annotations: an item is an entry of
# the list it takes (after `self`, for a method), a result an entry of the sequence it
# returns (of each sequence it yields, for a stream). A function that returns no
# sequence (an array, a mapping) gets results of type Any; with `collate` or `split` the
# function sees no list of items or returns no list of results, so both are Any.
# The overloads state the defaults a caller gets (the API reference shows them); the
# implementation takes None for "not given", to refuse a size or wait beside a batcher.
@overload
def batched(
    fn: Callable[[list[ItemT]], Sequence[ResultT]], /
) -> BatchedFunction[ItemT, ResultT]: ...
@overload
def batched(
    fn: Callable[[list[ItemT]], Awaitable[Sequence[ResultT]]], /
) -> BatchedFunction[ItemT, ResultT, Coroutine[Any, Any, ResultT]]: ...
@overload
def batched(
    fn: Callable[[list[ItemT]], Iterator[Sequence[ResultT]] | AsyncIterator[Sequence[ResultT]]], /
) -> BatchedFunction[ItemT, ResultT, Never]: ...
@overload
def batched(fn: Callable[[list[ItemT]], object], /) -> BatchedFunction[ItemT, Any, Any]: ...
@overload
def batched(
    fn: Callable[[Any, list[ItemT]], Sequence[ResultT]], /
) -> BatchedFunction[ItemT, ResultT]: ...
@overload
def batched(
    fn: Callable[[Any, list[ItemT]], Awaitable[Sequence[ResultT]]], /
) -> BatchedFunction[ItemT, ResultT, Coroutine[Any, Any, ResultT]]: ...
@overload
def batched(
    fn: Callable[
        [Any, list[ItemT]], Iterator[Sequence[ResultT]] | AsyncIterator[Sequence[ResultT]]
    ],
    /,
) -> BatchedFunction[ItemT, ResultT, Never]: ...
@overload
def batched(fn: Callable[[Any, list[ItemT]], object], /) -> BatchedFunction[ItemT, Any, Any]: ...
@overload
def batched(fn: Callable[..., Any], /) -> BatchedFunction[Any, Any, Any]: ...
@overload
def batched(
    *,
    max_batch_size: int | None = 32,
    max_wait_ms: float | None = 5.0,
    batcher: Batcher | None = None,
    collate: None = None,
    split: None = None,
    max_queue_size: int | None = None,
    max_concurrent_batches: int = 1,
    when_full: Literal["reject", "block"] = "reject",
    oom_errors: tuple[type[BaseException], ...] | None = None,
    on_oom: OnOom | Literal[False] | None = None,
    isolate_errors: bool = False,
    batch_timeout: float | None = None,
    max_latency_ms: float | None = None,
    clock: Clock | None = None,
    group: Callable[[Any], Hashable] | None = None,
    max_groups_per_batch: int | None = None,
    coalesce: bool | Callable[[Any], Hashable] = False,
    cache: MutableMapping[Hashable, Any] | None = None,
    shapes: ShapeBuckets | None = None,
    per_token: PerToken = None,
    state: None = None,
    session_idle_s: float | None = None,
    max_sessions: int | None = None,
    when_sessions_full: Literal["reject", "block"] = "reject",
    stack_states: bool = False,
) -> BatchedDecorator: ...
@overload
def batched(
    *,
    max_batch_size: int | None = 32,
    max_wait_ms: float | None = 5.0,
    batcher: Batcher | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    split: Callable[[Any], Sequence[Any]] | None = None,
    max_queue_size: int | None = None,
    max_concurrent_batches: int = 1,
    when_full: Literal["reject", "block"] = "reject",
    oom_errors: tuple[type[BaseException], ...] | None = None,
    on_oom: OnOom | Literal[False] | None = None,
    isolate_errors: bool = False,
    batch_timeout: float | None = None,
    max_latency_ms: float | None = None,
    clock: Clock | None = None,
    group: Callable[[Any], Hashable] | None = None,
    max_groups_per_batch: int | None = None,
    coalesce: bool | Callable[[Any], Hashable] = False,
    cache: MutableMapping[Hashable, Any] | None = None,
    shapes: ShapeBuckets | None = None,
    per_token: PerToken = None,
    state: None = None,
    session_idle_s: float | None = None,
    max_sessions: int | None = None,
    when_sessions_full: Literal["reject", "block"] = "reject",
    stack_states: bool = False,
) -> Callable[[Callable[..., Any]], BatchedFunction[Any, Any, Any]]: ...
@overload
def batched(
    *,
    max_batch_size: int | None = 32,
    max_wait_ms: float | None = 5.0,
    batcher: Batcher | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    split: Callable[[Any], Sequence[Any]] | None = None,
    max_queue_size: int | None = None,
    max_concurrent_batches: int = 1,
    when_full: Literal["reject", "block"] = "reject",
    oom_errors: tuple[type[BaseException], ...] | None = None,
    on_oom: OnOom | Literal[False] | None = None,
    isolate_errors: bool = False,
    batch_timeout: float | None = None,
    max_latency_ms: float | None = None,
    clock: Clock | None = None,
    group: Callable[[Any], Hashable] | None = None,
    max_groups_per_batch: int | None = None,
    coalesce: bool | Callable[[Any], Hashable] = False,
    cache: MutableMapping[Hashable, Any] | None = None,
    shapes: ShapeBuckets | None = None,
    per_token: PerToken = None,
    state: Callable[..., Any],
    session_idle_s: float | None = None,
    max_sessions: int | None = None,
    when_sessions_full: Literal["reject", "block"] = "reject",
    stack_states: bool = False,
) -> Callable[[Callable[[Any, Any], Any]], BatchedFunction[Any, Any, Any]]: ...


def batched(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    max_batch_size: int | None = None,
    max_wait_ms: float | None = None,
    batcher: Batcher | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    split: Callable[[Any], Sequence[Any]] | None = None,
    max_queue_size: int | None = None,
    max_concurrent_batches: int = 1,
    when_full: Literal["reject", "block"] = "reject",
    oom_errors: tuple[type[BaseException], ...] | None = None,
    on_oom: OnOom | Literal[False] | None = None,
    isolate_errors: bool = False,
    batch_timeout: float | None = None,
    max_latency_ms: float | None = None,
    clock: Clock | None = None,
    group: Callable[[Any], Hashable] | None = None,
    max_groups_per_batch: int | None = None,
    coalesce: bool | Callable[[Any], Hashable] = False,
    cache: MutableMapping[Hashable, Any] | None = None,
    shapes: ShapeBuckets | None = None,
    per_token: PerToken = None,
    state: Callable[..., Any] | None = None,
    session_idle_s: float | None = None,
    max_sessions: int | None = None,
    when_sessions_full: Literal["reject", "block"] = "reject",
    stack_states: bool = False,
) -> Any:
    """Decorate a batch function (list of items -> sequence of results).

    Callers then pass one item and get one result; the items of concurrent callers
    run together, in batches formed by the policy. Use it bare (`@batched`) for the
    defaults, or called (`@batched(max_batch_size=16)`) with options; it also
    decorates methods (one queue per instance) and async functions.

    A generator function (or async generator function) streams: each `yield` is a
    sequence with one entry per item (a chunk, [`END`][batchkit.END] to end that
    item's stream, or an exception instance to fail that item's stream alone), read
    by callers with [`stream`][batchkit.BatchedFunction.stream] or
    [`astream`][batchkit.BatchedFunction.astream].

    Reliability: a batch that runs out of memory is split in halves and retried,
    down to single items, and the size that worked becomes its bucket's effective
    maximum (probed upward again after 32 successful batches at it). Before each
    retry everything the failed attempt held is released (its argument, and the
    locals of its traceback's frames), then `on_oom()` runs. A batch whose `collate`
    fails is always split the same way, so a malformed item fails only its own
    caller. Streams are never split and retried (their delivered chunks cannot be
    taken back); a failing `collate` still costs only the malformed items.

    Args:
        fn: The batch function. It is called with the batch (a list of items, or
            what `collate` made of it) and returns one result per item, in order (a
            sequence whose `len()` is the batch's size, or whatever `split` turns into
            one; a mapping of batch-leading arrays, such as a Hugging Face
            `ModelOutput`, is split per item as [`unstack`][batchkit.unstack] does,
            and a set is refused). A result that is an exception instance is raised
            to that item's caller alone. Under a policy with strict batch sizes the batch is padded
            up by repeating its last item, and the padding's results are dropped. Sync,
            async, generator and async generator functions all work. Positional only;
            omit it to get a decorator that takes the options.
        max_batch_size: The default policy's largest batch, in items (default 32).
            Only without `batcher` (pass it to the policy instead).
        max_wait_ms: The default policy's longest wait for a batch to fill, in
            milliseconds, counted from the oldest waiting request (default 5; while
            no batch is running, waiting requests leave at once). Only without
            `batcher`.
        batcher: The batching policy, e.g. [`SortedBatcher`][batchkit.SortedBatcher]
            or [`BucketedBatcher`][batchkit.BucketedBatcher]; None (the default) is
            [`DynamicBatcher`][batchkit.DynamicBatcher] with `max_batch_size` and
            `max_wait_ms`.
        collate: Builds the function's argument from the batch's list of items
            (e.g. a padded tensor); None (the default) passes the list itself.
        split: Turns the function's output into its per-item results (e.g.
            [`unstack`][batchkit.unstack]); None (the default) takes the output as the sequence of
            results. An error in it, or a wrong number of results, fails every item
            of the batch.
        max_queue_size: How many requests may wait (queued, not yet running); None
            (the default) is no bound. When it is reached a call raises
            [`QueueFull`][batchkit.QueueFull] at once (`map` enqueues all its items
            or none), or waits for room with `when_full="block"`.
        max_concurrent_batches: How many batches may run at once (worker threads of a
            sync function, tasks of an async one); default 1. While fewer run, the
            next batch forms from everything that arrived in the meantime.
        when_full: What a call does when `max_queue_size` requests wait: `"reject"`
            (the default) raises [`QueueFull`][batchkit.QueueFull]; `"block"` waits
            for room, first come first served, within the caller's `timeout` (then
            [`RequestTimeout`][batchkit.RequestTimeout]), and needs a
            `max_queue_size`.
        oom_errors: A tuple of extra exception types that mean "this batch did not fit in
            memory", added to the built-in ones (`MemoryError` and
            `torch.cuda.OutOfMemoryError`); None (the default) is the built-in ones
            only, and `()` turns out-of-memory splitting off (such an error then
            fails the batch like any other).
        on_oom: Called with no argument after each out-of-memory failure, before
            the retry. None (the default) empties the CUDA cache when torch has
            already initialised CUDA (it never initialises CUDA itself); False runs
            nothing. An exception it raises is logged, and the retry goes on.
        isolate_errors: When the function raises for a batch, re-run it in halves
            (a binary search) so that only the items that fail alone get the
            exception and the others get their results: with `k` failing items among
            `n`, about `2 * k * log2(n)` extra calls at most, none when nothing
            fails. False (the default): the exception fails every item of the batch.
        batch_timeout: Seconds one call of the function may run (each call of a
            split batch is timed on its own); None (the default) is no bound. Past
            it, the callers of that batch get [`BatchTimeout`][batchkit.BatchTimeout]
            and serving goes on: an async call is cancelled; a sync function's stuck
            worker thread is abandoned (its late result dropped) and replaced, up to
            `max_concurrent_batches` stuck threads (past that, none is replaced and
            `stats().healthy` is False until one returns). A timed-out batch is not
            retried. Not applied to generator (streaming) functions.
        max_latency_ms: Each request's latency target, in milliseconds from its
            admission to its result (to its last chunk, for a stream); None (the
            default) for none. The function then learns how long its batches take
            (a robust fit of `a + b * size + c * cost` to the recent batches, in
            [`stats`][batchkit.BatchedFunction.stats] as `latency_model`) and, once
            it has seen 8 batches: refuses at once, with
            [`Overloaded`][batchkit.Overloaded], a call it predicts would be late
            given the work ahead of it; drops, with the same error and before they
            run, waiting requests that could no longer be in time even alone; sends
            a batch off before its max wait when waiting longer would make its
            oldest request late; and forms no batch so large that its most urgent
            request would be late. `Overloaded` is a
            [`QueueFull`][batchkit.QueueFull]: one `except QueueFull` handles both.
        clock: A monotonic clock in seconds, read for max waits, caller timeouts and
            the latencies in [`stats`][batchkit.BatchedFunction.stats]; None (the
            default) is `time.monotonic`. Tests inject a fake one.
        group: Batch only items of one group together: called once per item at call
            time (its exception, or an unhashable result, fails only that caller),
            it returns any hashable (a model, adapter or task name). Every batch then
            holds items of at most `max_groups_per_batch` groups; the group of the
            oldest waiting request goes first (priorities still outrank age), and
            within a group the policy's rules apply as without groups.
            [`stats`][batchkit.BatchedFunction.stats] reports each group's requests,
            batches and waits (`groups`). Only without `batcher` (pass it to the
            policy instead: every policy takes `group`).
        max_groups_per_batch: The most groups one batch may hold (default 1 with
            `group`); a batch of one group that leaves short is filled from the
            next oldest groups. Only with `group`.
        coalesce: Compute identical requests once: True (the item itself is the
            key; it must be hashable) or a function item -> hashable key (equal
            keys promise equal results; with `group`, the key includes the group).
            A call whose key is already waiting or running joins it instead of
            queueing: the function sees each key in flight once, and every caller
            gets the outcome (an error too). A caller that times out or is
            cancelled leaves; a request nobody waits for any more is withdrawn
            before it runs. The shared request waits at its most urgent caller's
            priority; a caller that joins is never refused (`QueueFull`,
            `Overloaded`). The first caller gets the result object, the others a
            `copy.deepcopy` each (a result that cannot be copied is shared).
            A key function that raises fails only its caller. False (the default)
            runs every call. Not for generator functions (a `TypeError`).
        cache: A mapping-like object (`dict`, `cachetools.LRUCache`, an adapter to
            an external store) that keeps successful results by the `coalesce`
            key (the item itself without one); a call whose key it holds is
            answered at once, never queued, with a `copy.deepcopy` of the entry.
            It implies coalescing. A look-up or a store that raises (other than
            a miss's `KeyError`) is logged and the call served all the same.
            Access is serialised by a lock of the function's; a mapping shared
            by several functions (or every instance of a method) needs keys that
            tell them apart. Empty it with
            [`cache_clear`][batchkit.BatchedFunction.cache_clear] or the mapping's
            own API. None (the default) keeps nothing.
        shapes: A [`ShapeBuckets`][batchkit.ShapeBuckets] grid of static
            shapes, declared once: the policy pads each batch up to a grid batch
            size (repeating its last item) and batches requests by the grid length
            they pad to; `collate` pads to that cell when it is
            [`pad`][batchkit.collate.pad.pad], [`pack_varlen`][batchkit.pack_varlen] or a
            [`PadCollator`][batchkit.PadCollator]; the dummy rows and padding are
            removed before any caller sees a result, and an item longer than the
            grid's largest length fails its call with a `ValueError` naming its
            length. None (the default): no grid, or the `batcher`'s own.
        per_token: How the layout's inverse reads the function's output (see
            [`split`][batchkit.Padded.split]): None (the default) by each leaf's
            shape (warning where a 2-D leaf's shape cannot tell), True every leaf
            per token, False every leaf by row (pooled), or the keys of a mapping
            output that are per token.
        state: Makes the function stateful (sessions): `state()` makes a session's
            first state (`state(key)` if it needs an argument). The function is then called as
            `fn(batch, states)` (`states` holds one state per item, in the batch's
            order) and returns `(results, new_states)`, one entry each; callers
            pass `f(chunk, session=key)` or `await f.acall(chunk, session=key)`.
            A session's requests run one at a time, in the order they were made;
            different sessions batch together. A request that fails (its result is
            an exception, its batch raised or timed out, its caller was cancelled
            before it settled) leaves its session's state as it was before it.
            States are values: return new ones rather than change them in place.
            See the guide's "Stateful sessions".
        session_idle_s: End a session that has had nothing queued for this many
            seconds (on `clock`; checked on each call, `end_session` and `stats`);
            None (the default) for never. Only with `state`.
        max_sessions: The most live sessions; None (the default) for no bound. Only
            with `state`.
        when_sessions_full: What a call that would start a session past
            `max_sessions` does: `"reject"` (the default) raises
            [`TooManySessions`][batchkit.TooManySessions]; `"block"` waits, within
            the caller's `timeout`, until a session ends.
        stack_states: Keep every session's state as a row of one stacked array
            (numpy, or a torch tensor on its device): the function gets the batch's
            rows gathered by index, `(batch, *state_shape)`, and returns new states
            stacked the same way. False (the default): a list of per-session
            objects of any type.

    Returns:
        With `fn`: the [`BatchedFunction`][batchkit.BatchedFunction] wrapping it.
        Without: a decorator that makes one.

    Raises:
        TypeError: An option has the wrong type (the message names it): a
            string, a bool or None where a number is needed, `batcher` not a
            [`Batcher`][batchkit.Batcher], `fn`, `collate`, `split`, `group`,
            `clock` or `on_oom` not callable, `isolate_errors` not a bool, a
            `when_full` that is not a string, `oom_errors` holding something
            that is not an exception type, `coalesce` neither a bool nor callable,
            `cache` not a mapping, or `coalesce` or `cache` for a generator
            function.
        ValueError: An option has a value out of range (the message names it):
            `max_batch_size` or `max_wait_ms` beside a `batcher`, a `max_queue_size`
            or `max_concurrent_batches` below 1, an unknown `when_full`,
            `when_full="block"` without a `max_queue_size`, a `batch_timeout` or
            `max_latency_ms` that is not a finite number above 0, a wait or timeout
            longer than the platform's timers take (`threading.TIMEOUT_MAX`
            seconds), `group` or `max_groups_per_batch` beside a `batcher`, or a
            `max_groups_per_batch` that is not a whole number >= 1 or is given
            without `group`, a session option without `state`, `state` with
            `when_full="block"`, a `session_idle_s` that is not a finite number
            above 0, or a `max_sessions` below 1.
    """
    batcher = policy_of(batcher, max_batch_size, max_wait_ms, group, max_groups_per_batch, shapes)
    check_serving_options(
        max_queue_size,
        max_concurrent_batches,
        when_full,
        batch_timeout,
        max_latency_ms,
        isolate_errors,
        clock,
    )
    for name, cb in (("collate", collate), ("split", split)):
        if cb is not None and not callable(cb):
            raise TypeError(f"{name} must be callable, got {type(cb).__name__}")
    batcher, collate = collate_and_policy(batcher, collate)
    options = Options(
        policy=batcher,
        collate=collate,
        split=split,
        max_queue_size=max_queue_size,
        max_concurrent_batches=max_concurrent_batches,
        clock=clock or time.monotonic,
        oom=oom_recovery(oom_errors, on_oom),
        batch_timeout=None if batch_timeout is None else float(batch_timeout),
        max_latency_s=None if max_latency_ms is None else max_latency_ms / 1e3,
        isolate_errors=isolate_errors,
        when_full=when_full,
        coalesce=coalesce,
        cache=cache,
        per_token=per_token,
        sessions=session_options(
            state, session_idle_s, max_sessions, when_sessions_full, stack_states, when_full
        ),
    )

    def wrap(func: Callable[..., Any]) -> BatchedFunction[Any, Any]:
        if not callable(func):
            raise TypeError(f"@batched needs a callable, got {type(func).__name__}")
        wrapper: BatchedFunction[Any, Any] = BatchedFunction(func, options)
        functools.update_wrapper(wrapper, func, updated=())  # type: ignore[arg-type]
        return wrapper

    return wrap(fn) if fn is not None else wrap


def streams_error(name: str, *, is_async: bool) -> TypeError:
    """The error for a generator function called as a plain one."""
    if is_async:
        return TypeError(f"{name} streams: use 'async for chunk in {name}.astream(x)'")
    return TypeError(
        f"{name} streams: use 'for chunk in {name}.stream(x)' (or "
        f"'async for chunk in {name}.astream(x)' from asyncio)"
    )


def plain_error(name: str, how: str, *, is_async: bool) -> TypeError:
    """The error for a plain function read as a stream (`how`: stream or astream)."""
    call = f"await {name}.acall(x)" if is_async else f"{name}(x) or await {name}.acall(x)"
    return TypeError(f"{name} is not a generator function, so it does not {how}: use {call}")


def sessions_map_error(name: str) -> TypeError:
    """The error for `map`/`amap` on a stateful function."""
    return TypeError(
        f"{name} keeps sessions (state=): call it once per chunk, "
        f"{name}(chunk, session=key), in the session's order"
    )


def session_layer(sessions: Sessions | None, name: str, session: Hashable | None) -> Sessions:
    """The session layer, for a call with `session` (refused unless the function
    keeps sessions and the call names one)."""
    if sessions is None:
        raise TypeError(f"{name} keeps no sessions: session= and end= need @batched(state=...)")
    if session is None:
        raise TypeError(
            f"{name} keeps sessions (state=): call it with a session key, "
            f"{name}(chunk, session=key)"
        )
    return sessions
