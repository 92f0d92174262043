"""Every option of `@batched` and of `f.configure()` is checked before anything runs: a
value of the wrong type raises TypeError, a value of the right type out of its range
ValueError, both naming the option. The tables below must name every parameter of
both signatures (read with `inspect`), so a new option cannot go unchecked. Waits and
timeouts longer than the platform's timers take are refused, not accepted and then
fatal to a worker or the timer thread."""

from __future__ import annotations

import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import batchkit
from batchkit import BatchedFunction, DynamicBatcher


def echo(xs: list[Any]) -> list[Any]:
    return xs


def by_task(item: Any) -> str:
    return "task"


LONGER_THAN_TIMERS_TAKE = 1e300  # seconds or milliseconds: past threading.TIMEOUT_MAX

# Options that only mean something beside another one.
NEEDS: dict[str, dict[str, Any]] = {
    "max_groups_per_batch": {"group": by_task},
    "when_full": {"max_queue_size": 4},
    "session_idle_s": {"state": dict},
    "max_sessions": {"state": dict},
    "when_sessions_full": {"state": dict, "max_sessions": 2},
    "stack_states": {"state": dict},
}
# A value of the wrong type for each option of @batched, by name.
BATCHED_WRONG_TYPE: dict[str, object] = {
    "fn": 5,
    "max_batch_size": "32",
    "max_wait_ms": "a",
    "batcher": "dynamic",
    "collate": 5,
    "split": "unstack",
    "max_queue_size": "100",
    "max_concurrent_batches": 2.0j,
    "when_full": 1,
    "oom_errors": 5,
    "on_oom": "empty",
    "isolate_errors": "yes",
    "batch_timeout": "30",
    "max_latency_ms": True,
    "clock": 0.0,
    "group": "task",
    "max_groups_per_batch": "2",
    "coalesce": 5,
    "cache": [],
    "shapes": (8, 16),
    "per_token": "tokens",  # one key is not a collection of keys
    "state": 5,
    "session_idle_s": "10",
    "max_sessions": "2",
    "when_sessions_full": 1,
    "stack_states": "yes",
}
# A value of the right type out of its range, by name; None: every value of the right
# type is valid (a callable, a flag, a policy).
BATCHED_WRONG_VALUE: dict[str, object] = {
    "fn": None,
    "max_batch_size": 0,
    "max_wait_ms": LONGER_THAN_TIMERS_TAKE,
    "batcher": None,
    "collate": None,
    "split": None,
    "max_queue_size": 0,
    "max_concurrent_batches": 1.5,
    "when_full": "drop",
    "oom_errors": None,
    "on_oom": None,
    "isolate_errors": None,
    "batch_timeout": LONGER_THAN_TIMERS_TAKE,
    "max_latency_ms": LONGER_THAN_TIMERS_TAKE,
    "clock": None,
    "group": None,
    "max_groups_per_batch": 0,
    "coalesce": None,
    "cache": None,
    "shapes": None,  # every ShapeBuckets is valid (its own arguments are checked in it)
    "per_token": None,
    "state": None,
    "session_idle_s": -1.0,
    "max_sessions": 0,
    "when_sessions_full": "drop",
    "stack_states": None,
}
CONFIGURE_WRONG_TYPE: dict[str, object] = {
    "max_batch_size": "8",
    "max_wait_ms": "a",
    "max_concurrent_batches": True,
    "max_queue_size": [10],
    "max_latency_ms": "100",
}
CONFIGURE_WRONG_VALUE: dict[str, object] = {
    "max_batch_size": -1,
    "max_wait_ms": LONGER_THAN_TIMERS_TAKE,
    "max_concurrent_batches": 0,
    "max_queue_size": 2.5,
    "max_latency_ms": LONGER_THAN_TIMERS_TAKE,
}


def decorate(name: str, value: object) -> BatchedFunction[Any, Any]:
    """`@batched` with one option set (and what it needs beside it)."""
    if name == "fn":
        return batchkit.batched(value)  # type: ignore[arg-type]
    options = {**NEEDS.get(name, {}), name: value}
    return batchkit.batched(**options)(echo)  # type: ignore[no-any-return]


def batched_options() -> list[str]:
    return list(inspect.signature(batchkit.batched).parameters)


def configure_options() -> list[str]:
    return [n for n in inspect.signature(BatchedFunction.configure).parameters if n != "self"]


def test_the_tables_name_every_option_of_batched_and_configure() -> None:
    assert set(batched_options()) == set(BATCHED_WRONG_TYPE) == set(BATCHED_WRONG_VALUE)
    assert set(configure_options()) == set(CONFIGURE_WRONG_TYPE) == set(CONFIGURE_WRONG_VALUE)


@pytest.mark.parametrize("name", batched_options())
def test_a_wrong_type_for_batched_is_a_type_error_naming_the_option(name: str) -> None:
    with pytest.raises(TypeError, match=name if name != "fn" else "callable"):
        decorate(name, BATCHED_WRONG_TYPE[name])


@pytest.mark.parametrize(
    "name", [n for n in batched_options() if BATCHED_WRONG_VALUE[n] is not None]
)
def test_a_wrong_value_for_batched_is_a_value_error_naming_the_option(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        decorate(name, BATCHED_WRONG_VALUE[name])


@pytest.mark.parametrize(
    ("name", "bad", "error"),
    [(n, CONFIGURE_WRONG_TYPE[n], TypeError) for n in configure_options()]
    + [(n, CONFIGURE_WRONG_VALUE[n], ValueError) for n in configure_options()],
)
def test_a_bad_live_setting_raises_naming_it_and_changes_nothing(
    name: str, bad: object, error: type[Exception]
) -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=3, max_latency_ms=100)(echo)
    before = f.configure()
    with pytest.raises(error, match=name):
        f.configure(**{name: bad})
    assert f.configure() == before
    f.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: batchkit.batched(max_wait_ms=1e300),
        lambda: batchkit.batched(batch_timeout=1e300),
        lambda: batchkit.batched(max_latency_ms=1e300),
        lambda: DynamicBatcher(4, max_wait_ms=1e300),
        lambda: batchkit.batched(echo).configure(max_wait_ms=1e300),
    ],
)
def test_a_wait_longer_than_the_platforms_timers_take_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match=r"longer than this platform's timers take"):
        make()


def test_the_longest_wait_and_timeout_taken_serve_calls() -> None:
    longest = threading.TIMEOUT_MAX
    f = batchkit.batched(
        max_wait_ms=longest * 1000, batch_timeout=longest, max_latency_ms=longest * 1000
    )(echo)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda i: f(i, timeout=10), range(32))) == list(range(32))
    assert f.stats().healthy
    f.close()
