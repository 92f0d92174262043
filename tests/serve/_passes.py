"""The scheduler driven the way the serving core drives it, for tests: an admission,
one scheduling pass."""

from __future__ import annotations

from batchkit.errors import Overloaded
from batchkit.serve.request import Request
from batchkit.serve.scheduler import FormedBatch, Scheduler


def poll(
    sched: Scheduler, now: float, dropped: list[Request] | None = None
) -> tuple[FormedBatch | None, float | None]:
    """`sched.decide(now)`: its batch and when to look again. The requests it dropped as
    too late are appended to `dropped` (when given); the candidates of a policy
    `select` that raised are dropped all the same, and its error is raised here."""
    batch, wake_at, gone = sched.decide(now)
    late = [req for req in gone if isinstance(req.error, Overloaded)]
    failed = [req for req in gone if not isinstance(req.error, Overloaded)]
    if dropped is not None:
        dropped.extend(late)
    if failed:
        raise failed[0].error  # type: ignore[misc]
    return batch, wake_at


def admit(sched: Scheduler, req: Request, dropped: list[Request] | None = None) -> None:
    """`sched.add(req)`: its refusal is raised here. The waiting requests it dropped
    as too late are appended to `dropped` (when given)."""
    admission = sched.add(req)
    if dropped is not None:
        dropped.extend(admission.dropped)
    if admission.refused is not None:
        raise admission.refused
