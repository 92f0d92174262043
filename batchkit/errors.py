"""batchkit's own exceptions, shared by every layer (serving, continuous batching, KV
blocks): callers see these beyond their function's own errors."""

from __future__ import annotations


class BatchkitError(Exception):
    """Base class of batchkit's own runtime errors."""


class BatcherClosed(BatchkitError, RuntimeError):
    """The batcher is closed: it accepts no new requests, or closed before serving this one."""


class QueueFull(BatchkitError, RuntimeError):
    """``max_queue_size`` requests are already waiting; this one was not enqueued."""


class RequestTimeout(BatchkitError, TimeoutError):
    """The request's ``timeout`` passed before it started running; it will not run."""


class BatchTimeout(BatchkitError, TimeoutError):
    """The batch function ran past ``batch_timeout`` on this request's batch: the batch
    was given up (its slot freed; a stuck sync worker thread is replaced), so this
    request has no result. Not a [`RequestTimeout`][batchkit.RequestTimeout]: the
    request did start."""


class BatchInterrupted(BatchkitError):
    """The user's code run for a batch (the batch or step function, `collate`,
    `split`) raised `SystemExit`, `KeyboardInterrupt` or `asyncio.CancelledError`.
    There it is no real exit, Ctrl-C or cancellation of the callers, and passed on as
    it is it would stop every asyncio caller's event loop; so the requests it concerns
    get this error, caused by it (`__cause__`), and serving goes on."""


class Overloaded(QueueFull):
    """The request would miss its latency target (`max_latency_ms`): refused at once,
    or dropped while it waited, before it ran.

    A [`QueueFull`][batchkit.QueueFull]: both mean "busy now, retry later or
    elsewhere", so `except QueueFull` catches both (a service answers both with 503).
    The message gives the predicted and the target times.

    Args:
        message: What was predicted, against which target.
        predicted_s: The predicted seconds from admission to its result.
        target_s: The target, `max_latency_ms` in seconds.

    Attributes:
        predicted_s: The predicted seconds from admission to its result.
        target_s: The target, `max_latency_ms` in seconds.
    """

    def __init__(self, message: str, *, predicted_s: float, target_s: float) -> None:
        super().__init__(message)
        self.predicted_s = predicted_s
        self.target_s = target_s


class TooManySessions(QueueFull):
    """`max_sessions` sessions are live: this call would start a new session, and it
    was not queued (with `when_sessions_full="reject"`, the default). The live
    sessions go on; ending one (`end_session`, `end=True`, or `session_idle_s`) makes
    room. A [`QueueFull`][batchkit.QueueFull]: `except QueueFull` handles both."""
