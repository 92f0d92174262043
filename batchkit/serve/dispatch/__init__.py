"""When a batch leaves: dispatch rules the scheduler asks in order, one per module.

Each rule answers, for one bucket, when its batch should leave (see
`batchkit.serve.dispatch.rule.DispatchRule`); `rules_for` lists the rules a policy
and a latency target ask for, in the order their reasons are recorded: full,
closing, idle, max wait, deadline.
"""

from __future__ import annotations

from batchkit.batchers.base import Batcher
from batchkit.serve.dispatch.closing import WhenClosing
from batchkit.serve.dispatch.deadline import BeforeDeadline
from batchkit.serve.dispatch.full import WhenFull
from batchkit.serve.dispatch.idle import WhenIdle
from batchkit.serve.dispatch.max_wait import AfterMaxWait
from batchkit.serve.dispatch.rule import DispatchReason, DispatchRule
from batchkit.serve.targets import LatencyTarget

__all__ = [
    "AfterMaxWait",
    "BeforeDeadline",
    "DispatchReason",
    "DispatchRule",
    "WhenClosing",
    "WhenFull",
    "WhenIdle",
    "rules_for",
]


def rules_for(
    policy: Batcher, target: LatencyTarget | None, *, closing: bool = False
) -> list[DispatchRule]:
    """The rules that send a policy's batches, in the order they are asked.

    Args:
        policy: The batching policy (its `max_tokens`, `dispatch_when_idle` and
            `max_wait_s`).
        target: The latency target, or None.
        closing: The function is closing: what waits leaves at once.
    """
    rules: list[DispatchRule] = [WhenFull(policy)]
    if closing:
        rules.append(WhenClosing())
    if policy.dispatch_when_idle:
        rules.append(WhenIdle())
    if policy.max_wait_s is not None:
        rules.append(AfterMaxWait(policy.max_wait_s))
    if target is not None:
        rules.append(BeforeDeadline(target))
    return rules
