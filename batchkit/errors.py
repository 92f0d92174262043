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

