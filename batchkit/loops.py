"""Reaching an event loop from any thread: what serving and continuous batching both do
to answer a caller on its own loop, so it lives below both."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def on_loop_thread(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the calling thread is running ``loop`` right now.

    Args:
        loop: An event loop, or None (then False).
    """
    return loop is not None and asyncio._get_running_loop() is loop


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Run ``fn(*args)`` on ``loop``: at once when this thread runs it, else scheduled
    thread-safely.

    Args:
        loop: The event loop to run it on.
        fn: The callback.
        *args: Its arguments.

    Returns:
        False when ``loop`` is closed: nobody is left there to run it.
    """
    if asyncio._get_running_loop() is loop:
        fn(*args)
        return True
    return schedule_on_loop(loop, fn, *args)


def schedule_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Schedule ``fn(*args)`` on ``loop`` (never run inline), from any thread.

    No self-pipe write when this thread runs ``loop``.

    Args:
        loop: The event loop to run it on.
        fn: The callback.
        *args: Its arguments.

    Returns:
        False when ``loop`` is closed.
    """
    try:
        if asyncio._get_running_loop() is loop:
            loop.call_soon(fn, *args)
        else:
            loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed
        return False
    return True
