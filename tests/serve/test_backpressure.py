"""Waiting for queue room (when_full="block"): who is woken, and what a timeout counts."""

from __future__ import annotations

import asyncio
import time

import pytest

import batchkit
from batchkit import RequestTimeout
from batchkit.serve.backpressure import RoomWaiters


def test_block_mode_map_timeout_counts_the_blocked_enqueue() -> None:
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, max_queue_size=1, when_full="block")(
        lambda xs: (time.sleep(0.3), xs)[1]
    )
    start = time.monotonic()
    with pytest.raises(RequestTimeout):
        f.map(["a", "b", "c"], timeout=0.5)
    assert time.monotonic() - start < 0.85
    f.close()


def test_room_wake_skips_waiters_whose_loop_is_closed() -> None:
    room = RoomWaiters()
    dead = asyncio.new_event_loop()
    room.add_async(dead)
    dead.close()
    alive = room.add_thread()
    room.wake(1)  # the closed loop's waiter cannot be woken: the next one must be
    assert alive.acquire(timeout=1)
    assert len(room) == 0
