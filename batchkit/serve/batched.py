"""``@batched``: call a batch function one item at a time, from threads or asyncio."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

from batchkit.batchers.base import Batcher, check_positive_int
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.serve.callers import AsyncCall
from batchkit.serve.core import ServingCore
from batchkit.serve.event_loop import LoopDriver
from batchkit.serve.events import Listener
from batchkit.serve.options import Clock, OomRecovery, Options, empty_cuda_cache
from batchkit.serve.settings import Settings
from batchkit.serve.stats import Stats
from batchkit.serve.threads import ThreadDriver

R = TypeVar("R")


class Driver(Protocol):
    """What runs a batched function's batches and waits for its callers: worker threads
    (:class:`~batchkit.serve.threads.ThreadDriver`) or one event loop
    (:class:`~batchkit.serve.event_loop.LoopDriver`), over one serving core."""

    core: ServingCore

    def call(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        """``f(x)``: a sync function's result, an async function's awaitable."""
        ...

    def call_many(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """``f.map(items)``, blocking."""
        ...

    acall: AsyncCall
    """``await f.acall(x, *, priority=0, timeout=None)``."""

    async def amap(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """``await f.amap(items)``."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, drain, then fail what is left after ``timeout``."""
        ...

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from asyncio."""
        ...

    def stream(
        self, item: Any, *, priority: int = 0, timeout: float | None = None
    ) -> Iterator[Any]:
        """``f.stream(x)``: a streaming function's chunks, from a thread."""
        ...

    def astream(
        self, item: Any, *, priority: int = 0, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """``f.astream(x)``: its chunks, from asyncio."""
        ...


class BatchedFunction(Generic[R]):
    """A batch function wrapped so that callers pass one item and get one result.

    Created by :func:`batched`. Sync functions: ``f(x)`` blocks the calling thread;
    async functions: ``f(x)`` returns an awaitable. ``await f.acall(x)`` works for
    both (a sync function then runs on a worker thread, never on the loop).
    """

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
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
        self._bound_by_instance: weakref.WeakKeyDictionary[Any, BatchedFunction[R]] = (
            weakref.WeakKeyDictionary()
        )
        # Created now (cheap: no thread starts before the first call), so that
        # ``f.acall`` is the driver's own ``async def acall`` (same signature) even when
        # a caller keeps the bound method: one coroutine per call instead of two.
        core = ServingCore(options, self.__qualname__)
        self._driver: Driver = (LoopDriver if self.is_async else ThreadDriver)(fn, core)
        if not self.streams:
            self.acall = self._driver.acall  # type: ignore[method-assign,assignment]

    @property
    def runtime(self) -> Driver:
        """The driver behind this function: its workers, and its queue (``runtime.core``)."""
        return self._driver

    # -- methods: one queue per instance --------------------------------------
    def __set_name__(self, owner: type, name: str) -> None:
        self._attr_name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        with self._bind_lock:  # two threads' first access must share one queue
            return self._bound_for(instance, owner)

    def _bound_for(self, instance: Any, owner: type | None) -> BatchedFunction[R]:
        name = getattr(self, "_attr_name", None)
        if name is not None and isinstance(getattr(instance, "__dict__", None), dict):
            cached: BatchedFunction[R] | None = instance.__dict__.get(name)
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
    def __call__(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        """Run one item in a batch. Sync function: its result; async function: an awaitable."""
        if self.streams:
            raise self._streams_error()
        return self._driver.call(item, priority=priority, timeout=timeout)

    def _streams_error(self) -> TypeError:
        name = self.__name__
        if self.is_async:
            return TypeError(f"{name} streams: use 'async for chunk in {name}.astream(x)'")
        return TypeError(
            f"{name} streams: use 'for chunk in {name}.stream(x)' (or "
            f"'async for chunk in {name}.astream(x)' from asyncio)"
        )

    def _plain_error(self, how: str) -> TypeError:
        name = self.__name__
        call = f"await {name}.acall(x)" if self.is_async else f"{name}(x) or await {name}.acall(x)"
        return TypeError(f"{name} is not a generator function, so it does not {how}: use {call}")

    async def acall(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        """Run one item in a batch, from asyncio (sync or async function alike).

        ``timeout``: seconds before the item must have started running, else
        :class:`~batchkit.RequestTimeout`. Lower ``priority`` values are served first.
        """
        if self.streams:
            raise self._streams_error()
        return await self._driver.acall(item, priority=priority, timeout=timeout)

    # -- streams ----------------------------------------------------------------
    def stream(
        self, item: Any, *, priority: int = 0, timeout: float | None = None
    ) -> Iterator[Any]:
        """One item's chunks, from a thread, as the batch's generator yields them.

        For a sync generator function. The item is queued at once (streams made one
        after another batch together); ``timeout`` bounds the wait before its batch
        starts. Stopping early (``break``, ``close()``) drops the rest of this stream
        only; once every caller of a batch has left, its generator is closed.
        """
        if not self.streams:
            raise self._plain_error("stream")
        return self._driver.stream(item, priority=priority, timeout=timeout)

    def astream(
        self, item: Any, *, priority: int = 0, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """One item's chunks, from asyncio (sync or async generator function alike).

        Call it inside a coroutine; a sync generator runs on a worker thread and its
        chunks reach this loop without blocking it. ``aclose()``, ``break`` or a
        cancelled task leaves the stream (see :meth:`stream`).
        """
        if not self.streams:
            raise self._plain_error("astream")
        return self._driver.astream(item, priority=priority, timeout=timeout)

    # -- many items ------------------------------------------------------------
    def map(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """Run many items; results in input order. Raises the first failed item's error
        (in input order) once every item has finished."""
        if self.streams:
            raise self._streams_error()
        return self._driver.call_many(items, priority=priority, timeout=timeout)

    async def amap(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """:meth:`map` from asyncio, for sync and async functions."""
        if self.streams:
            raise self._streams_error()
        return await self._driver.amap(items, priority=priority, timeout=timeout)

    # -- introspection and lifetime ---------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Observe every batch and every dropped request (see :mod:`batchkit.serve.events`)."""
        self._driver.core.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop observing."""
        self._driver.core.remove_listener(listener)

    def stats(self) -> Stats:
        """A snapshot: requests, batches, batch sizes, waits, latencies, dispatch reasons."""
        return self._driver.core.stats()

    def configure(
        self,
        *,
        max_batch_size: int | None = None,
        max_wait_ms: float | None = None,
        max_concurrent_batches: int | None = None,
        max_queue_size: int | None = None,
    ) -> Settings:
        """Change settings while serving; with no argument, read them.

        What is given changes at once, atomically, for batches formed from then on (a
        running batch is not touched; a larger size or concurrency wakes the scheduler
        at once). Thread-safe under load: nothing queued is lost or run twice.

        Args:
            max_batch_size: The policy's largest batch.
            max_wait_ms: The policy's longest wait for a batch to fill (milliseconds);
                a policy without one (``StaticBatcher``) refuses it by name.
            max_concurrent_batches: Batches that may run at once.
            max_queue_size: Requests that may wait (a bound; ``None`` leaves it as it is).

        Returns:
            The settings in force afterwards.

        Raises:
            ValueError: A value is not valid, or the policy has no such setting;
                nothing was changed.
        """
        return self._driver.core.configure(
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            max_concurrent_batches=max_concurrent_batches,
            max_queue_size=max_queue_size,
        )

    def load(self) -> tuple[int, int]:
        """``(queue depth, batches in flight)`` now, cheaply (what a metrics scrape reads)."""
        return self._driver.core.load()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting (later calls raise ``BatcherClosed``), finish what is queued and
        running; after ``timeout`` seconds, fail what is left with ``BatcherClosed``."""
        self._driver.close(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from asyncio."""
        await self._driver.aclose(timeout)

    def __enter__(self) -> BatchedFunction[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> BatchedFunction[R]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<batched {self.__qualname__} {self.options.policy!r}>"


OnOom = Callable[[], None]


def _oom_recovery(
    oom_errors: type[BaseException] | tuple[type[BaseException], ...] | None,
    on_oom: OnOom | Literal[False] | None,
) -> OomRecovery:
    """``oom_errors``: None (the default) the built-in out-of-memory types; ``()`` turns
    splitting off. ``on_oom``: None the default hook; False none."""
    if on_oom is not None and on_oom is not False and not callable(on_oom):
        raise TypeError(f"on_oom must be callable, None or False, got {type(on_oom).__name__}")
    hook = empty_cuda_cache if on_oom is None else (on_oom or None)
    if oom_errors is None:
        return OomRecovery(on_oom=hook)
    if isinstance(oom_errors, type):
        oom_errors = (oom_errors,)
    for t in oom_errors:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"oom_errors must hold exception types, got {t!r}")
    return OomRecovery(enabled=len(oom_errors) > 0, extra_types=tuple(oom_errors), on_oom=hook)


def _check_serving_options(
    max_queue_size: int | None,
    max_concurrent_batches: int,
    when_full: str,
    batch_timeout: float | None,
) -> None:
    """ValueError naming the first option of ``@batched`` that is not valid."""
    check_positive_int("max_queue_size", max_queue_size, allow_none=True)
    check_positive_int("max_concurrent_batches", max_concurrent_batches)
    if when_full not in ("reject", "block"):
        raise ValueError(f'when_full must be "reject" or "block", got {when_full!r}')
    if when_full == "block" and max_queue_size is None:
        raise ValueError('when_full="block" needs a max_queue_size')
    if batch_timeout is not None and (
        isinstance(batch_timeout, bool)
        or not isinstance(batch_timeout, (int, float))
        or not 0 < batch_timeout < float("inf")
    ):
        raise ValueError(f"batch_timeout must be a number of seconds > 0, got {batch_timeout!r}")


@overload
def batched(fn: Callable[[Any], R], /) -> BatchedFunction[R]: ...
@overload
def batched(
    *,
    max_batch_size: int | None = ...,
    max_wait_ms: float | None = ...,
    batcher: Batcher | None = ...,
    collate: Callable[[list[Any]], Any] | None = ...,
    split: Callable[[Any], Sequence[Any]] | None = ...,
    max_queue_size: int | None = ...,
    max_concurrent_batches: int = ...,
    when_full: Literal["reject", "block"] = ...,
    oom_errors: tuple[type[BaseException], ...] | None = ...,
    on_oom: OnOom | Literal[False] | None = ...,
    isolate_errors: bool = ...,
    batch_timeout: float | None = ...,
    clock: Clock | None = ...,
) -> Callable[[Callable[[Any], R]], BatchedFunction[R]]: ...


def batched(
    fn: Callable[[Any], Any] | None = None,
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
    clock: Clock | None = None,
) -> Any:
    """Decorate a batch function (list of items -> sequence of results).

    A generator function (or async generator function) streams: each ``yield`` is a
    sequence with one entry per item (a chunk, :data:`batchkit.END`, or an exception
    for that item alone), read by callers with :meth:`BatchedFunction.stream` /
    :meth:`BatchedFunction.astream`.

    Defaults to ``DynamicBatcher(max_batch_size=32, max_wait_ms=5)``; pass
    ``batcher=`` for another policy (then ``max_batch_size``/``max_wait_ms`` belong
    to it). ``collate(items)`` builds the function's argument and ``split(output)``
    its per-item results. ``max_queue_size`` waiting requests make further calls
    raise ``QueueFull`` at once, or with ``when_full="block"`` wait for room (within
    their ``timeout``). ``clock`` replaces ``time.monotonic`` (tests).

    Reliability: a batch that runs out of memory (``MemoryError``,
    ``torch.cuda.OutOfMemoryError``, plus any ``oom_errors`` types) is split in
    halves and retried down to single items, and the size that worked becomes the
    bucket's effective maximum (probed upward again later); ``oom_errors=()`` turns
    this off. Before each retry, everything the failed attempt held is released (its
    argument, and the locals of its traceback's frames), then ``on_oom()`` runs: by
    default it empties the CUDA cache when torch has initialised CUDA; ``on_oom=False``
    turns it off. ``isolate_errors=True`` re-runs a failing batch in halves so that
    only the items that fail alone get the exception. A batch whose ``collate`` fails
    is always split the same way: a malformed item fails only its own caller.

    ``batch_timeout``: seconds one call of the function may run. Past it, that batch's
    callers get ``BatchTimeout`` and serving goes on: an async call is cancelled; a
    sync function's stuck worker thread is abandoned (its late result dropped) and
    replaced, up to ``max_concurrent_batches`` stuck threads (past that, no more are
    spawned and ``stats().healthy`` is False until one returns).
    """
    if batcher is not None and (max_batch_size is not None or max_wait_ms is not None):
        raise ValueError("pass max_batch_size/max_wait_ms to the batcher, not to @batched")
    if batcher is None:
        batcher = DynamicBatcher(
            32 if max_batch_size is None else max_batch_size,
            5.0 if max_wait_ms is None else max_wait_ms,
        )
    elif not isinstance(batcher, Batcher):
        raise TypeError(f"batcher must be a batchkit Batcher, got {type(batcher).__name__}")
    _check_serving_options(max_queue_size, max_concurrent_batches, when_full, batch_timeout)
    for name, cb in (("collate", collate), ("split", split)):
        if cb is not None and not callable(cb):
            raise TypeError(f"{name} must be callable, got {type(cb).__name__}")
    options = Options(
        policy=batcher,
        collate=collate,
        split=split,
        max_queue_size=max_queue_size,
        max_concurrent_batches=max_concurrent_batches,
        clock=clock or time.monotonic,
        oom=_oom_recovery(oom_errors, on_oom),
        batch_timeout=None if batch_timeout is None else float(batch_timeout),
        isolate_errors=bool(isolate_errors),
        when_full=when_full,
    )

    def wrap(func: Callable[[Any], Any]) -> BatchedFunction[Any]:
        if not callable(func):
            raise TypeError(f"@batched needs a callable, got {type(func).__name__}")
        wrapper: BatchedFunction[Any] = BatchedFunction(func, options)
        functools.update_wrapper(wrapper, func, updated=())  # type: ignore[arg-type]
        return wrapper

    return wrap(fn) if fn is not None else wrap
