"""Serving: `@batched`, and what runs it (a pure scheduler, a serving core, a driver for
threads or an event loop); its errors, statistics and events."""

from batchkit.errors import (
    BatcherClosed,
    BatchInterrupted,
    BatchkitError,
    BatchTimeout,
    Overloaded,
    QueueFull,
    RequestTimeout,
    TooManySessions,
)
from batchkit.percentiles import Percentiles
from batchkit.serve.batched import BatchedFunction, batched
from batchkit.serve.channels import END
from batchkit.serve.events import BatchEvent, DropEvent, Listener
from batchkit.serve.options import Settings
from batchkit.serve.scheduler import Scheduler
from batchkit.serve.stats import DispatchReason, GroupStats, Stats
from batchkit.serve.targets import LearnedLatency

__all__ = [
    "END",
    "BatchEvent",
    "BatchInterrupted",
    "BatchTimeout",
    "BatchedFunction",
    "BatcherClosed",
    "BatchkitError",
    "DispatchReason",
    "DropEvent",
    "GroupStats",
    "LearnedLatency",
    "Listener",
    "Overloaded",
    "Percentiles",
    "QueueFull",
    "RequestTimeout",
    "Scheduler",
    "Settings",
    "Stats",
    "TooManySessions",
    "batched",
]
