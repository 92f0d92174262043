"""The group limit of the continuous-batching scheduler: at most ``max_groups_per_step``
groups (adapters, tasks) run at once, waiting ones admitted as running ones drain.

Requests are admitted first-come-first-served (within a priority) as without groups,
while their group runs already or the running set has fewer groups than the limit.
The first waiting sequence the limit stops (the oldest, within its priority) holds a
**reservation**: sequences behind it may still join, but only those of a running
group that cannot make their group last longer: their work left (`tokens_left`: the
tokens they may still compute) at most that of the longest-running member of their
group (the group's **horizon**). This is backfilling: the rows a draining group
leaves are used, and its drain is never delayed.

The bound: every step that admits anyone has budget left after the running
sequences, so it computes at least one token of every running sequence, and every
horizon shrinks by at least one; no other step makes one grow. So the blocked
sequence's group may join once ``W`` such steps have run, ``W`` the smallest
horizon when it was first blocked (at most the longest running sequence's tokens
left); with a budget that covers every running sequence each step, within ``W``
steps. More urgent requests (lower ``priority`` values) still go first, and a
sequence preempted for KV blocks waits in line by its own arrival, so it may be
ahead of the blocked one and lengthen its wait.

An urgent request of a group that does not run while the group set is full takes
the place of a whole running group: the least urgent group whose sequences are all
less urgent than it is preempted (see `group_to_free`).
"""

from __future__ import annotations

from collections.abc import Hashable

from batchkit.generate.sequence import Sequence


def tokens_left(seq: Sequence, max_model_len: int | None) -> int:
    """The most tokens ``seq`` may still compute before it finishes.

    Its tokens not computed yet (the rest of its prompt, or all of them waiting: a
    prefix-cache hit only saves some), then one per token it may still sample after
    the next one, within ``max_new_tokens`` and ``max_model_len``.

    Args:
        seq: A waiting or running sequence.
        max_model_len: The scheduler's ``max_model_len`` (None: no limit).
    """
    n = seq.num_tokens
    samples = seq.max_new_tokens - seq.num_generated
    if max_model_len is not None:
        samples = min(samples, max_model_len - n)
    return n - seq.num_computed_tokens + samples - 1


class GroupGate:
    """One step's admissions of waiting sequences under the group limit.

    Built after the running sequences are scheduled; the scheduler asks
    [`admits`][batchkit.generate.groups.GroupGate.admits] of each waiting sequence
    in line and calls [`joined`][batchkit.generate.groups.GroupGate.joined] for
    each it admits.

    Args:
        limit: ``max_groups_per_step``.
        running: The scheduler's running sequences (the live list: admissions join it).
        max_model_len: The scheduler's ``max_model_len``.
    """

    __slots__ = ("limit", "running", "max_model_len", "counts", "horizons")

    def __init__(self, limit: int, running: list[Sequence], max_model_len: int | None) -> None:
        self.limit = limit
        self.running = running
        self.max_model_len = max_model_len
        self.counts: dict[Hashable, int] = {}  # running sequences by group
        for seq in running:
            self.counts[seq.group] = self.counts.get(seq.group, 0) + 1
        # Set when the first sequence is blocked (the reservation): group -> horizon.
        self.horizons: dict[Hashable, int] | None = None

    def admits(self, seq: Sequence) -> bool:
        """Whether ``seq``, next in line, may join now.

        Its group must run already or fit under the limit; behind a blocked sequence,
        its work left must be within its group's horizon. The first sequence refused
        for the limit takes the reservation.

        Args:
            seq: A waiting sequence.
        """
        counts, group = self.counts, seq.group
        if group in counts:
            horizons = self.horizons
            return horizons is None or tokens_left(seq, self.max_model_len) <= horizons[group]
        if len(counts) < self.limit:  # (never behind a blocked one: the set is full)
            return True
        if self.horizons is None:
            self.horizons = self._horizons()
        return False

    def joined(self, seq: Sequence) -> None:
        """``seq`` was admitted (its group runs now).

        Args:
            seq: The sequence admitted.
        """
        self.counts[seq.group] = self.counts.get(seq.group, 0) + 1

    def _horizons(self) -> dict[Hashable, int]:
        """Each running group's horizon: its longest-running sequence's tokens left."""
        out: dict[Hashable, int] = {}
        limit = self.max_model_len
        for seq in self.running:
            left = tokens_left(seq, limit)
            if left > out.get(seq.group, -1):
                out[seq.group] = left
        return out


def blocked_by_limit(limit: int, running: list[Sequence], seq: Sequence) -> bool:
    """Whether the group limit keeps ``seq`` out of ``running`` as it is.

    Args:
        limit: ``max_groups_per_step``.
        running: The running sequences.
        seq: A waiting sequence.
    """
    groups = {s.group for s in running}
    return seq.group not in groups and len(groups) >= limit


def group_to_free(head: Sequence, running: list[Sequence]) -> list[Sequence] | None:
    """The running group an urgent ``head`` may take the place of, its sequences the
    least urgent first; None if no group is all less urgent than ``head``.

    Of the groups whose every running sequence is less urgent (a higher ``priority``
    value), the one whose most urgent sequence is the least urgent (the newest among
    equals).

    Args:
        head: The first waiting sequence, blocked by the group limit.
        running: The running sequences.
    """
    members: dict[Hashable, list[Sequence]] = {}
    for seq in running:
        members.setdefault(seq.group, []).append(seq)
    candidates = [
        group_seqs
        for group_seqs in members.values()
        if all(s.priority > head.priority for s in group_seqs)
    ]
    if not candidates:
        return None
    chosen = max(candidates, key=lambda seqs: min((s.priority, s.order) for s in seqs))
    return sorted(chosen, key=lambda s: (s.priority, s.order), reverse=True)
