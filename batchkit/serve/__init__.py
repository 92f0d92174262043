"""The runtime: ``@batched``, its queue-and-worker core, errors and stats."""

from batchkit.serve.batched import BatchedFunction, batched
from batchkit.serve.errors import BatcherClosed, BatchkitError, QueueFull, RequestTimeout
from batchkit.serve.scheduler import Scheduler
from batchkit.serve.stats import DispatchReason, Percentiles, Stats

__all__ = [
    "BatchedFunction",
    "BatcherClosed",
    "BatchkitError",
    "DispatchReason",
    "Percentiles",
    "QueueFull",
    "RequestTimeout",
    "Scheduler",
    "Stats",
    "batched",
]
