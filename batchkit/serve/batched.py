"""``@batched``: call a batch function one item at a time, from threads or asyncio."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

from batchkit.batchers.base import Batcher, check_positive_int
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.serve.events import Listener
from batchkit.serve.looped import LoopRuntime
from batchkit.serve.request import await_request
from batchkit.serve.runtime import Clock, Options, Runtime
from batchkit.serve.stats import Stats
from batchkit.serve.threaded import ThreadRuntime

R = TypeVar("R")


class BatchedFunction(Generic[R]):
    """A batch function wrapped so that callers pass one item and get one result.

    Created by :func:`batched`. Sync functions: ``f(x)`` blocks the calling thread;
    async functions: ``f(x)`` returns an awaitable. ``await f.acall(x)`` works for
    both (a sync function then runs on a worker thread, never on the loop).
    """

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        self.fn = fn
        self.options = options
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        )
        self.__name__ = getattr(fn, "__name__", "batched")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn
        self._runtime_lock = threading.RLock()
        self._bound_by_instance: weakref.WeakKeyDictionary[Any, BatchedFunction[R]] = (
            weakref.WeakKeyDictionary()
        )
        # Created now (cheap: no thread starts before the first call), so that
        # ``f.acall`` is the runtime's own ``async def acall`` (same signature) even when
        # a caller keeps the bound method: one coroutine per call instead of two.
        kind = LoopRuntime if self.is_async else ThreadRuntime
        self._runtime: Runtime = kind(fn, options, self.__qualname__)
        self.acall = self._runtime.acall  # type: ignore[method-assign]

    @property
    def runtime(self) -> Runtime:
        """The queue and workers behind this function."""
        return self._runtime

    # -- methods: one queue per instance --------------------------------------
    def __set_name__(self, owner: type, name: str) -> None:
        self._attr_name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        with self._runtime_lock:  # two threads' first access must share one queue
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
        runtime = self.runtime
        if isinstance(runtime, LoopRuntime):
            return runtime.acall(item, priority=priority, timeout=timeout)
        assert isinstance(runtime, ThreadRuntime)
        return runtime.call(item, priority, timeout)

    async def acall(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        """Run one item in a batch, from asyncio (sync or async function alike).

        ``timeout``: seconds before the item must have started running, else
        :class:`~batchkit.RequestTimeout`. Lower ``priority`` values are served first.
        """
        return await self.runtime.acall(item, priority=priority, timeout=timeout)

    # -- many items ------------------------------------------------------------
    def map(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """Run many items; results in input order. Raises the first failed item's error
        (in input order) once every item has finished."""
        if self.is_async:
            raise TypeError(f"{self.__name__} is async: use 'await {self.__name__}.amap(items)'")
        runtime = self.runtime
        assert isinstance(runtime, ThreadRuntime)
        reqs = [runtime.make_request(x, priority, None) for x in items]
        # Every item's timeout runs from this call, as if each were called alone now (a
        # blocked enqueue included): at the deadline, items not yet started are withdrawn.
        deadline = None if timeout is None else time.monotonic() + timeout
        if runtime.room_mode_block:
            runtime.submit_all_blocking(reqs, timeout)
        else:
            runtime.submit_many(reqs)
        for i, req in enumerate(reqs):
            left = None if deadline is None else deadline - time.monotonic()
            if not req.wait(left):
                assert timeout is not None
                for late in reqs[i:]:
                    runtime.give_up(late, runtime.timeout_error(timeout), timed_out=True)
                deadline = None
                req.wait(None)  # answered now: by the timeout, or by its running batch
        return [req.outcome() for req in reqs]

    async def amap(
        self, items: Iterable[Any], *, priority: int = 0, timeout: float | None = None
    ) -> list[Any]:
        """:meth:`map` from asyncio, for sync and async functions."""
        runtime = self.runtime
        loop = asyncio.get_running_loop()
        runtime.bind(loop)
        reqs = [runtime.make_request(x, priority, loop) for x in items]
        started = time.monotonic()
        if runtime.room_mode_block:
            await runtime.asubmit_all_blocking(reqs, timeout)
        else:
            runtime.submit_many(reqs)
        left = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        waits = [asyncio.ensure_future(await_request(runtime, r, left)) for r in reqs]
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        for out in outcomes:
            if isinstance(out, BaseException):
                raise out
        return list(outcomes)

    # -- introspection and lifetime ---------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Observe every batch and every dropped request (see :mod:`batchkit.serve.events`)."""
        runtime = self.runtime
        with runtime.lock:
            runtime.listeners = [*runtime.listeners, listener]

    def remove_listener(self, listener: Listener) -> None:
        """Stop observing."""
        runtime = self.runtime
        with runtime.lock:
            runtime.listeners = [x for x in runtime.listeners if x is not listener]

    def stats(self) -> Stats:
        """A snapshot: requests, batches, batch sizes, waits, latencies, dispatch reasons."""
        return self.runtime.stats()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting (later calls raise ``BatcherClosed``), finish what is queued and
        running; after ``timeout`` seconds, fail what is left with ``BatcherClosed``."""
        runtime = self.runtime
        if isinstance(runtime, (ThreadRuntime, LoopRuntime)):
            runtime.close(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from asyncio."""
        runtime = self.runtime
        if isinstance(runtime, (ThreadRuntime, LoopRuntime)):
            await runtime.aclose(timeout)

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


_UNSET: Any = object()


def _oom_types(
    oom_errors: tuple[type[BaseException], ...] | None,
) -> tuple[type[BaseException], ...] | None:
    """None (the default): the built-in out-of-memory types; () turns splitting off."""
    if oom_errors is None:
        return ()
    if isinstance(oom_errors, type):
        oom_errors = (oom_errors,)
    if len(oom_errors) == 0:
        return None
    for t in oom_errors:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"oom_errors must hold exception types, got {t!r}")
    return tuple(oom_errors)


@overload
def batched(fn: Callable[[Any], R], /) -> BatchedFunction[R]: ...
@overload
def batched(
    *,
    max_batch_size: int = ...,
    max_wait_ms: float = ...,
    batcher: Batcher | None = ...,
    collate: Callable[[list[Any]], Any] | None = ...,
    split: Callable[[Any], Sequence[Any]] | None = ...,
    max_queue_size: int | None = ...,
    max_concurrent_batches: int = ...,
    when_full: Literal["reject", "block"] = ...,
    oom_errors: tuple[type[BaseException], ...] | None = ...,
    isolate_errors: bool = ...,
    clock: Clock | None = ...,
) -> Callable[[Callable[[Any], R]], BatchedFunction[R]]: ...


def batched(
    fn: Callable[[Any], Any] | None = None,
    /,
    *,
    max_batch_size: int = _UNSET,
    max_wait_ms: float = _UNSET,
    batcher: Batcher | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    split: Callable[[Any], Sequence[Any]] | None = None,
    max_queue_size: int | None = None,
    max_concurrent_batches: int = 1,
    when_full: Literal["reject", "block"] = "reject",
    oom_errors: tuple[type[BaseException], ...] | None = None,
    isolate_errors: bool = False,
    clock: Clock | None = None,
) -> Any:
    """Decorate a batch function (list of items -> sequence of results).

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
    this off. ``isolate_errors=True`` re-runs a failing batch in halves so that only
    the items that fail alone get the exception. A batch whose ``collate`` fails is
    always split the same way: a malformed item fails only its own caller.
    """
    if batcher is not None and (max_batch_size is not _UNSET or max_wait_ms is not _UNSET):
        raise ValueError("pass max_batch_size/max_wait_ms to the batcher, not to @batched")
    if batcher is None:
        batcher = DynamicBatcher(
            32 if max_batch_size is _UNSET else max_batch_size,
            5.0 if max_wait_ms is _UNSET else max_wait_ms,
        )
    elif not isinstance(batcher, Batcher):
        raise TypeError(f"batcher must be a batchkit Batcher, got {type(batcher).__name__}")
    check_positive_int("max_queue_size", max_queue_size, allow_none=True)
    check_positive_int("max_concurrent_batches", max_concurrent_batches)
    if when_full not in ("reject", "block"):
        raise ValueError(f'when_full must be "reject" or "block", got {when_full!r}')
    if when_full == "block" and max_queue_size is None:
        raise ValueError('when_full="block" needs a max_queue_size')
    oom_types = _oom_types(oom_errors)
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
        oom_errors=oom_types,
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
