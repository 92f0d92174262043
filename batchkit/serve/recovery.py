"""Running one formed batch until every request has exactly one outcome.

A batch may be split in halves and its parts re-run:

- on out-of-memory (``MemoryError``, ``torch.cuda.OutOfMemoryError``, plus the
  ``oom_errors`` types given to ``@batched``), down to single items; the size that
  worked becomes the bucket's effective maximum;
- when ``collate`` fails: a malformed item must fail only its own caller;
- when the function raises and ``isolate_errors=True``: a binary search for the
  poison items. With ``k`` failing items among ``n``, at most about
  ``2 * k * log2(n)`` extra calls are made; with none, no extra call at all.

Anything else (a wrong number of results, an error without isolation) fails the
whole part, which is the whole batch unless an out-of-memory split happened.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Generator, Iterable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

from batchkit.serve.request import Request

if TYPE_CHECKING:
    from batchkit.serve.runtime import Options
    from batchkit.serve.scheduler import FormedBatch


class Stage(Enum):
    """Where a part failed."""

    COLLATE = "collate"
    CALL = "call"
    OUTPUT = "output"  # split() or the length check


def is_oom(exc: BaseException, extra: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc`` means "this batch did not fit in memory"."""
    if isinstance(exc, (MemoryError, *extra)):
        return True
    torch = sys.modules.get("torch")  # only if the process uses torch at all
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return isinstance(oom_type, type) and isinstance(exc, oom_type)


Part = tuple[int, int]  # [start, stop) positions in the batch


class BatchRun:
    """The parts of one batch still to run, and the outcomes settled so far.

    Outcomes are kept by position: ``values[i]`` is the result for
    ``requests[i]`` unless ``errors`` holds an exception for ``i``.
    """

    __slots__ = (
        "requests",
        "oom_enabled",
        "oom_extra",
        "isolate_errors",
        "_todo",
        "values",
        "errors",
        "calls",
        "oom_splits",
        "isolated",
        "largest_ok",
    )

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        oom_enabled: bool,
        oom_extra: tuple[type[BaseException], ...],
        isolate_errors: bool,
    ) -> None:
        self.requests = requests
        self.oom_enabled = oom_enabled
        self.oom_extra = oom_extra
        self.isolate_errors = isolate_errors
        self._todo: list[Part] = [(0, len(requests))]
        self.values: list[Any] = [None] * len(requests)
        self.errors: dict[int, BaseException] = {}  # position -> that request's error
        self.calls = 0
        self.oom_splits = 0  # parts split because they ran out of memory
        self.isolated = 0  # items that failed alone after a split
        self.largest_ok = 0  # the largest call (padded size) the function completed

    def next_part(self) -> Part | None:
        """The next part to run (left halves first), or None when all are settled."""
        return self._todo.pop() if self._todo else None

    def succeeded(self, part: Part, results: Iterable[Any], padded: int) -> None:
        """The function, called with ``padded`` items, returned ``results``: one per item
        of ``part`` first (the padding's results after them are ignored). A result that
        is an exception instance is that item's error."""
        start, stop = part
        # (No padding: one C-level copy instead of islice's item by item.)
        chunk = list(results if padded == stop - start else itertools.islice(results, stop - start))
        if len(chunk) != stop - start:  # len() said otherwise: e.g. a table iterating columns
            raise ValueError(
                f"the output's len() is {padded} but iterating it yielded {len(chunk)} results"
            )
        self.largest_ok = max(self.largest_ok, padded)  # caps count what the function saw
        values = self.values
        values[start:stop] = chunk
        # One C-level scan; the Python loop runs only when some slot holds an exception.
        if any(map(isinstance, chunk, itertools.repeat(BaseException))):
            for i in range(start, stop):
                if isinstance(values[i], BaseException):
                    self.errors[i] = values[i]

    def failed(self, part: Part, exc: BaseException, stage: Stage) -> None:
        """``part`` raised ``exc`` at ``stage``: split it and retry, or settle it with ``exc``."""
        start, stop = part
        size = stop - start
        oom = self.oom_enabled and stage is Stage.CALL and is_oom(exc, self.oom_extra)
        retry = oom or stage is Stage.COLLATE or (stage is Stage.CALL and self.isolate_errors)
        if retry and size > 1:
            self.oom_splits += oom
            middle = start + (size + 1) // 2
            self._todo.append((middle, stop))
            self._todo.append((start, middle))  # popped first: keeps the input order
            return
        if size < len(self.requests):
            self.isolated += size
        for i in range(start, stop):
            self.errors[i] = exc

    @property
    def hit_oom(self) -> bool:
        """Whether any part ran out of memory."""
        return self.oom_splits > 0


class BatchSteps:
    """The one recipe for running a batch, shared by both runtimes (a mixin of
    :class:`~batchkit.serve.runtime.Runtime`): collate each part, call, split and check
    the output, record each slot's outcome, split and retry as :class:`BatchRun` says."""

    options: Options
    name: str

    def start_run(self, batch: FormedBatch) -> BatchRun:
        """The bookkeeping for running ``batch``, with its split-and-retry rules."""
        oom = self.options.oom_errors
        return BatchRun(
            batch.requests,
            oom_enabled=oom is not None,
            oom_extra=oom or (),
            isolate_errors=self.options.isolate_errors,
        )

    def run_steps(self, batch: FormedBatch) -> Generator[Any, tuple[bool, Any], BatchRun]:
        """The one recipe for running a batch, for both runtimes.

        Yields each argument to call the function with, and is sent back
        ``(True, output)`` or ``(False, exception)``; returns the settled run once every
        request has its outcome (after any split-and-retry).
        """
        run = self.start_run(batch)
        while (part := run.next_part()) is not None:
            prepared = self.prepare(run, part)
            if prepared is None:
                continue
            padded, argument = prepared
            run.calls += 1
            ok, result = yield argument
            if ok:
                self.settle(run, part, padded, result)
            else:
                run.failed(part, result, Stage.CALL)
        return run

    def prepare(self, run: BatchRun, part: Part) -> tuple[int, Any] | None:
        """(padded size, function argument) for ``part``; None if collate failed (recorded)."""
        start, stop = part
        padded = self.options.policy.padded_size(stop - start)
        items = [req.item for req in run.requests[start:stop]]  # (beats attrgetter + map)
        if padded > len(items):  # strict sizes: repeat the last item; its results are dropped
            items.extend([items[-1]] * (padded - len(items)))
        collate = self.options.collate
        try:
            return padded, collate(items) if collate is not None else items
        except BaseException as exc:  # noqa: BLE001 - a bad item must not cost the others
            run.failed(part, exc, Stage.COLLATE)
            return None

    def settle(self, run: BatchRun, part: Part, padded: int, output: Any) -> None:
        """Record the function's output for ``part`` (split, length-checked, per slot)."""
        try:
            run.succeeded(part, self._results(padded, output), padded)
        except BaseException as exc:  # noqa: BLE001 - e.g. a bug in split()
            run.failed(part, exc, Stage.OUTPUT)

    def _results(self, padded: int, output: Any) -> Sequence[Any]:
        """The per-item results in ``output``, checked to be ``padded`` of them."""
        split = self.options.split
        results = split(output) if split is not None else output
        try:
            count = len(results)
        except TypeError:
            raise TypeError(
                f"{self.name} returned {type(results).__name__}, expected a sequence of "
                f"{padded} results (one per item)"
            ) from None
        if count != padded:
            raise ValueError(f"{self.name} returned {count} results for a batch of {padded} items")
        return results  # type: ignore[no-any-return]
