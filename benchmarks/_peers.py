"""Peer batching systems for ``online.py``, each behind one small adapter.

Every adapter is built fresh inside the event loop that drives it (several peers bind
to the loop they first run on) and exposes ``call(x) -> awaitable`` and ``close()``:

- ``minimal``: the well-known blog-post asyncio batcher (a queue and one collector task
  that waits until ``max_batch_size`` items or ``max_wait`` after the first), written
  here in ~40 lines, as the floor any library should beat;
- ``ray``: Ray Serve's ``@serve.batch`` on an ``async def`` method. It needs no Ray
  cluster, but its queue reads the deployment config and tags its metrics from the
  *replica context*, which only exists inside a Serve replica, so
  :func:`fake_ray_replica_context` installs one (Ray's own internal setter, the call
  a replica makes at start-up). No ``ray.init``: Serve's metrics then record nothing,
  which if anything flatters Ray;
- ``ray-stream``: the same for a *streaming* batch function, an async generator
  method under ``@serve.batch`` (each ``yield`` one list with an entry per item, the
  ``StopIteration`` class as an entry ending that item's stream); a call returns that
  item's async generator of chunks;
- ``floor``: not a batcher anyone should use, the least work one can do with one batch
  in flight (a list, a future per caller, one task per run of batches; no max wait, no
  timer, no checks): the reference for what this machine allows per request;
- ``mxbai-aio`` / ``mxbai-sync``: mixedbread's ``batched`` (``batched.aio.dynamically``
  on an async function; ``batched.dynamically`` on a sync function, served by its own
  thread, awaited with ``.acall``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

AsyncBatchFn = Callable[[list[Any]], Awaitable[list[Any]]]
AsyncStreamFn = Callable[[list[Any]], AsyncIterator[list[Any]]]


# --------------------------------------------------------------------------- minimal


class MinimalBatcher:
    """The blog-post pattern: ``await b(x)`` enqueues (x, future); one collector task
    takes the first item, then keeps taking until the batch is full or ``max_wait``
    has passed since that first item, runs the batch and resolves the futures."""

    def __init__(self, fn: AsyncBatchFn, max_batch_size: int, max_wait_s: float) -> None:
        self.fn, self.max_batch_size, self.max_wait_s = fn, max_batch_size, max_wait_s
        self.queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def __call__(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.task is None:
            self.task = loop.create_task(self._collect())
        fut = loop.create_future()
        self.queue.put_nowait((x, fut))
        return await fut

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            try:
                outs = await self.fn([x for x, _ in batch])
                for (_, fut), out in zip(batch, outs):
                    if not fut.done():
                        fut.set_result(out)
            except Exception as exc:  # noqa: BLE001
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class FloorBatcher:
    """The per-request floor: ``await b(x)`` appends (x, future); the first arrival with
    nothing running starts one task (in the next loop step, so a burst coalesces) that
    runs batches of up to ``max_batch_size`` back to back until none is left. Batches
    leave as soon as the task gets to them: there is no max wait to honour."""

    def __init__(self, fn: AsyncBatchFn, max_batch_size: int) -> None:
        self.fn, self.max_batch_size = fn, max_batch_size
        self.pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self.running = False

    async def __call__(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((x, fut))
        if not self.running:
            self.running = True
            loop.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        pending, size = self.pending, self.max_batch_size
        try:
            while pending:
                batch = pending[:size]
                del pending[:size]
                try:
                    outs = await self.fn([x for x, _ in batch])
                except Exception as exc:  # noqa: BLE001 - (off the measured path)
                    for _, fut in batch:
                        fut.set_exception(exc)
                    continue
                for (_, fut), out in zip(batch, outs):
                    fut.set_result(out)
        finally:
            self.running = False

    async def close(self) -> None:
        pass


# --------------------------------------------------------------------------- ray serve

_RAY_CONTEXT_SET = False


def fake_ray_replica_context() -> None:
    """Install the replica context that ``@serve.batch`` reads (once per process)."""
    global _RAY_CONTEXT_SET
    if _RAY_CONTEXT_SET:
        return
    from ray.serve import context
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.config import DeploymentConfig
    from ray.serve.schema import ReplicaRank

    context._set_internal_replica_context(
        replica_id=ReplicaID("bench", DeploymentID("bench", "bench")),
        servable_object=None,
        _deployment_config=DeploymentConfig(max_ongoing_requests=1_000_000),
        rank=ReplicaRank(rank=0, node_rank=0, local_rank=0),
        world_size=1,
    )
    _RAY_CONTEXT_SET = True


class RayServeBatcher:
    """``@serve.batch`` on a method of a class defined per instance (its queue is per
    decorated function and bound to the loop it is first used on)."""

    def __init__(
        self, fn: AsyncBatchFn, max_batch_size: int, max_wait_s: float, in_flight: int = 1
    ) -> None:
        from ray import serve

        fake_ray_replica_context()

        class Model:
            # (max_concurrent_batches only when asked for: older Ray has no such option)
            @serve.batch(
                max_batch_size=max_batch_size,
                batch_wait_timeout_s=max_wait_s,
                **({"max_concurrent_batches": in_flight} if in_flight != 1 else {}),
            )
            async def handle(self, xs: list[Any]) -> list[Any]:
                return await fn(xs)

        self._cls = Model
        self.model = Model()
        self.call = self.model.handle

    async def close(self) -> None:
        lazy = getattr(self._cls.handle, "_get_max_batch_size", None)
        lazy = getattr(lazy, "__self__", None)
        queue = getattr(lazy, "_queue", None)
        task = getattr(queue, "_handle_batch_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class RayServeStreamBatcher(RayServeBatcher):
    """``@serve.batch`` on an async generator method: ``call(x)`` is that item's async
    iterator of chunks. ``fn`` yields one list per step, an entry per item, with
    ``StopIteration`` (the class, which Ray compares entries against) to end one item's
    stream; its return ends every stream still open. Closed as ``RayServeBatcher``."""

    def __init__(self, fn: AsyncStreamFn, max_batch_size: int, max_wait_s: float) -> None:
        from ray import serve

        fake_ray_replica_context()

        class Model:
            @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=max_wait_s)
            async def handle(self, xs: list[Any]) -> AsyncIterator[list[Any]]:
                async for entries in fn(xs):
                    yield entries

        self._cls = Model
        self.model = Model()
        self.call = self.model.handle


# --------------------------------------------------------------------------- mixedbread


class MxbaiAsync:
    """``batched.aio.dynamically`` on an async batch function."""

    def __init__(self, fn: AsyncBatchFn, max_batch_size: int, max_wait_s: float) -> None:
        import batched

        self.proc = batched.aio.dynamically(
            fn, batch_size=max_batch_size, timeout_ms=max_wait_s * 1000
        )
        self.call = self.proc

    async def close(self) -> None:
        task = self.proc._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.proc._loop = None


class MxbaiSync:
    """``batched.dynamically`` on a sync batch function (its own thread); from asyncio
    callers use ``.acall``, from threads plain ``proc(x)``."""

    def __init__(
        self, fn: Callable[[list[Any]], list[Any]], max_batch_size: int, max_wait_s: float
    ) -> None:
        import batched

        self.proc = batched.dynamically(fn, batch_size=max_batch_size, timeout_ms=max_wait_s * 1000)
        self.call = self.proc.acall
        self.sync_call = self.proc

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.proc.shutdown)

    def close_sync(self) -> None:
        self.proc.shutdown()
