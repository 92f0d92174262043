"""What serves one batched function: the driver that runs its batches over the serving
core, and the layer its callers go through in front of the core.

A plain function's callers talk to the core itself. With `coalesce=` or `cache=`,
they talk to the coalescing layer (`batchkit.serve.coalesce`), which queues one
request per key. A stateful function (`state=`) is served by the session layer
(`batchkit.serve.sessions`): the core runs its wrapper of the function, and callers
go through it, one request per session at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batchkit.serve import callers
from batchkit.serve.coalesce import Coalescer, check_sharing
from batchkit.serve.core import ServingCore
from batchkit.serve.event_loop import LoopDriver
from batchkit.serve.options import Options
from batchkit.serve.sessions import Sessions
from batchkit.serve.threads import ThreadDriver


class Driver(Protocol):
    """What runs a batched function's batches: worker threads
    (`batchkit.serve.threads.ThreadDriver`) or one event loop
    (`batchkit.serve.event_loop.LoopDriver`), each over the serving core it made.
    Callers reach the core through `batchkit.serve.callers`, not through the driver."""

    core: ServingCore

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, drain, then fail what is left after `timeout`.

        Args:
            timeout: Seconds to wait before failing what is left with
                `BatcherClosed`; None waits for everything.
        """
        ...

    async def aclose(self, timeout: float | None = None) -> None:
        """`close` from asyncio.

        Args:
            timeout: Seconds to wait before failing what is left with
                `BatcherClosed`; None waits for everything.
        """
        ...

    def close_nowait(self) -> None:
        """Stop accepting and return at once: what is queued and running is served,
        then the workers exit (run when the function is dropped)."""
        ...


@dataclass(frozen=True)
class Layers:
    """The objects that serve one batched function.

    Attributes:
        driver: Runs the batches (its `core` queues the requests).
        front: Where a plain call goes: the core, or the coalescing layer.
        coalescer: The coalescing layer (`coalesce=` or `cache=`); None without.
        sessions: The session layer (`state=`); None for a stateless function.
    """

    driver: Driver
    front: callers.Front
    coalescer: Coalescer | None
    sessions: Sessions | None

    @property
    def core(self) -> ServingCore:
        """The serving core: the queue, the scheduler, the answers."""
        return self.driver.core

    def close(self, timeout: float | None) -> None:
        """Close the session layer (no new sessions), then the driver (see
        `Driver.close`)."""
        if self.sessions is not None:
            self.sessions.close()
        self.driver.close(timeout)

    async def aclose(self, timeout: float | None) -> None:
        """`close` from asyncio."""
        if self.sessions is not None:
            self.sessions.close()
        await self.driver.aclose(timeout)


def build_layers(
    fn: Callable[..., Any], options: Options, name: str, *, is_async: bool
) -> Layers:
    """The layers that serve `fn` under `options` (nothing starts yet: the driver's
    workers start on the first call).

    Args:
        fn: The batch function.
        options: Its checked options (`streaming` set).
        name: Its name, for errors and threads.
        is_async: It is a coroutine or async generator function.

    Raises:
        TypeError: `coalesce`, `cache` or `state` with a generator function; or a
            `coalesce`/`cache` of the wrong type (see `check_sharing`).
        ValueError: `state` with `coalesce` or `cache`.
    """
    check_sharing(options.coalesce, options.cache, streams=options.streaming)
    shares = options.coalesce is not False or options.cache is not None
    sessions, runs, core_options = None, fn, options
    if options.sessions is not None:
        if options.streaming:
            raise TypeError(
                f"{name} is a generator function: state= (sessions) needs a function "
                "that returns (results, new_states)"
            )
        if shares:
            raise ValueError(
                f"{name}: state= (sessions) takes no coalesce= or cache=: each chunk "
                "advances its session, so equal chunks are not one request"
            )
        sessions = Sessions(fn, options, name, is_async=is_async)
        runs, core_options = sessions.batch_function, sessions.core_options(options)
    driver: Driver = (
        LoopDriver(runs, core_options, name)
        if is_async
        else ThreadDriver(runs, core_options, name)
    )
    coalescer: Coalescer | None = None
    front: callers.Front = driver.core
    if shares:
        coalescer = Coalescer(driver.core, options.coalesce, options.cache, shares_loop=is_async)
        front = coalescer
    if sessions is not None:
        sessions.bind(driver.core)
    return Layers(driver, front, coalescer, sessions)
