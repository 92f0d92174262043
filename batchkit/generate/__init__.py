"""Continuous (iteration-level) batching for autoregressive generation.

``ContinuousBatcher`` drives a step function: every step, finished sequences leave and
waiting ones join, with chunked prefill, a token budget, and (with a
`BlockAllocator`) paged KV memory with preemption by recompute.
The scheduler core (``StepScheduler``) is pure and
usable on its own. Listeners
(``add_listener``) get a ``StepEvent`` per step and a ``FinishEvent`` per answered
request (``batchkit.metrics`` exports them to Prometheus). ``submit(..., sampling=Sampling(...))``
samples a request with its own generator; step functions pick tokens with
``next_tokens``. ``submit(..., group=...)`` tags a request with a group (an adapter,
a task), and ``max_groups_per_step`` bounds how many groups one step mixes.
``step_sizes`` pads every step to a size of a set, for a captured model.
"""

from batchkit.generate.batcher import ContinuousBatcher
from batchkit.generate.handle import GenerationHandle
from batchkit.generate.observe import FinishEvent, GenerationListener, StepEvent
from batchkit.generate.sampling import Sampling, TokenSampler, next_tokens
from batchkit.generate.scheduler import StepScheduler
from batchkit.generate.sequence import ScheduledSeq, SeqStatus, Sequence, StepBatch
from batchkit.generate.stats import GenerationGroupStats, GenerationStats

__all__ = [
    "ContinuousBatcher",
    "FinishEvent",
    "GenerationHandle",
    "GenerationListener",
    "GenerationStats",
    "GenerationGroupStats",
    "Sampling",
    "ScheduledSeq",
    "StepScheduler",
    "SeqStatus",
    "Sequence",
    "StepBatch",
    "StepEvent",
    "TokenSampler",
    "next_tokens",
]
