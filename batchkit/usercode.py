"""The one rule for what the user's own code raises, wherever batchkit runs it for
them: a batch or step function, `collate`, `split`, `key`/`group`, a listener, the
`on_oom` hook.

- An `Exception` fails the requests that code concerns, as it is; so does any other
  `BaseException` (`GeneratorExit`, a class of the user's own).
- A `SystemExit` or `KeyboardInterrupt` fails them as a
  [`BatchInterrupted`][batchkit.BatchInterrupted] caused by it (`__cause__`). Raised
  there, it is no exit and no Ctrl-C of the process: a real Ctrl-C reaches the main
  thread, and `asyncio.run` turns it into the cancellation of its main task, which is
  never caught here. Handed on as it is, it would stop every asyncio caller's event
  loop (asyncio re-raises those two out of `run_until_complete`, even under
  `gather(return_exceptions=True)`) and end a thread that serves other requests. An
  `asyncio.CancelledError` the code raised is no cancellation of its callers either:
  it becomes a `BatchInterrupted` too.
- Code that concerns no request (a listener, a hook) has whatever it raises logged,
  never passed on.

So nothing the user's code raises ends a worker thread, a driver task or a caller's
event loop: each caller gets its own outcome, and serving goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from batchkit.errors import BatchInterrupted

log = logging.getLogger("batchkit")

# What would stop a caller's loop, or pass for its own cancellation, if handed on as is.
_INTERRUPTS = (SystemExit, KeyboardInterrupt, asyncio.CancelledError)

Outcome = tuple[bool, Any]
"""One run of user code: `(True, what it returned)` or `(False, the error its requests
get)` (see `contained`)."""


def contained(exc: BaseException, name: str, source: str = "the batch function") -> BaseException:
    """What the requests concerned get for `exc`, raised (or returned as a result) by
    the user's code.

    Args:
        exc: What the code raised.
        name: The batched function's (or batcher's) name, for the message.
        source: Which piece of user code: `"the batch function"`, `"collate"`,
            `"split"`, `"the step function"`...

    Returns:
        `exc` itself, unless it is a `SystemExit`, `KeyboardInterrupt` or
        `asyncio.CancelledError`: then a `BatchInterrupted` naming `source`, whose
        `__cause__` is `exc`.
    """
    if not isinstance(exc, _INTERRUPTS):
        return exc
    kind = type(exc).__name__
    error = BatchInterrupted(
        f"{name}: {source} raised {kind}({exc}); its callers get this error instead "
        f"(the {kind} is its __cause__), and serving goes on"
    )
    error.__cause__ = exc
    return error


def run(fn: Callable[[Any], Any], argument: Any, name: str, source: str) -> Outcome:
    """Call `fn(argument)`, the user's code; never raises.

    Args:
        fn: The user's function.
        argument: Its one argument.
        name: The batched function's (or batcher's) name, for error messages.
        source: Which piece of user code `fn` is (see `contained`).

    Returns:
        `(True, fn(argument))`, or `(False, contained(what it raised))`.
    """
    try:
        return True, fn(argument)
    except BaseException as exc:  # noqa: BLE001 - the one place the rule is applied
        return False, contained(exc, name, source)


async def arun(
    fn: Callable[[Any], Awaitable[Any]], argument: Any, name: str, source: str
) -> Outcome:
    """`run` for an async function, awaited on the running loop: the same arguments and
    result. A cancellation is raised: it is the awaiting task's own (a driver
    cancelled, its loop shutting down), not the user's code failing.
    """
    try:
        return True, await fn(argument)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the one place the rule is applied
        return False, contained(exc, name, source)


def run_hook(hook: Callable[..., object], *args: Any, what: str) -> None:
    """Call `hook(*args)`, user code that concerns no request (a listener, the
    `on_oom` hook), for its effect; whatever it raises, a `BaseException` too, is
    logged and never raised.

    Args:
        hook: The user's callable.
        *args: Its arguments.
        what: What it is, for the log line (`"listener <...> on on_step"`).
    """
    try:
        hook(*args)
    except BaseException:  # noqa: BLE001 - the one place the rule is applied
        log.exception("batchkit: %s failed", what)
