"""Running one formed batch until every request has exactly one outcome: the one
recipe both drivers follow (collate, call, check the output, split and retry).

A batch may be split in halves and its parts re-run:

- on out-of-memory (`MemoryError`, `torch.cuda.OutOfMemoryError`, plus the
  `oom_errors` types given to `@batched`), down to single items; the size that
  worked becomes the bucket's effective maximum;
- when `collate` fails: a malformed item must fail only its own caller;
- when the function raises and `isolate_errors=True`: a binary search for the
  poison items. With `k` failing items among `n`, at most about
  `2 * k * log2(n)` extra calls are made; with none, no extra call at all.

A call that ran past `batch_timeout` is never retried. What the user's code (the
function, `collate`, `split`) raises settles its part by the rule of
`batchkit.usercode`: a `SystemExit` reaches the callers as a `BatchInterrupted`.

Anything else (a wrong number of results, an error without isolation) fails the
whole part, which is the whole batch unless an out-of-memory split happened.

Before a part is retried, everything the failed attempt held is released: its
argument, and the locals of every frame in its exception's traceback (chained
exceptions included), so that on a GPU the retry finds the memory the failed
forward pass used. An error handed to callers keeps its traceback, without frame
locals (so a caller holding it holds no tensors). See `release_frames`.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Generator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from enum import Enum
from typing import Any

from batchkit._backend import is_array
from batchkit.collate.inverse import Inverse, Layout, PerToken, split_outputs
from batchkit.collate.stack import unstack
from batchkit.errors import BatchTimeout
from batchkit.serve.options import OomRecovery, Options
from batchkit.serve.request import Request
from batchkit.usercode import Outcome, contained, run_hook

__all__ = ["BatchRun", "Outcome", "Stage", "contained", "release_frames", "run_steps"]

Part = tuple[int, int]  # [start, stop) positions in the batch


class Stage(Enum):
    """Where a part failed; its value names the user code run there (see `contained`)."""

    COLLATE = "collate"
    CALL = "the batch function"
    OUTPUT = "the output's split"  # split(), or the output's own len() and iteration


def release_frames(exc: BaseException, *, drop_traceback: bool) -> None:
    """Free what `exc`'s traceback keeps alive: clear the locals of its finished
    frames, and of its chained exceptions' (frames still running are skipped).

    Args:
        exc: The exception a failed attempt raised.
        drop_traceback: Also detach the tracebacks: the exception is discarded (a
            retry follows). False keeps them, for the callers that get the error.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)  # skips frames still running
            if drop_traceback:
                current.__traceback__ = None
        pending += (current.__cause__, current.__context__)


class BatchRun:
    """The parts of one batch still to run, and the outcomes settled so far.

    Outcomes are kept by position: `values[i]` is the result for
    `requests[i]` unless `errors` holds an exception for `i`.

    Args:
        requests: The batch's requests, in batch order.
        options: The function's options: out-of-memory handling (which errors split
            a part, and the hook to run), `isolate_errors` (split a part whose call
            raised, to find the failing items) and `split` (an output's per-item
            results).
    """

    __slots__ = (
        "requests",
        "oom",
        "isolate_errors",
        "split",
        "per_token",
        "todo",
        "values",
        "errors",
        "calls",
        "oom_splits",
        "isolated",
        "largest_ok",
        "first_output_at",
    )

    def __init__(self, requests: Sequence[Request], options: Options) -> None:
        self.requests = requests
        self.oom = options.oom
        self.isolate_errors = options.isolate_errors
        self.split = options.split
        self.per_token = options.per_token
        self.todo: list[Part] = [(0, len(requests))]  # parts still to run, the next last
        self.values: list[Any] = [None] * len(requests)
        self.errors: dict[int, BaseException] = {}  # position -> that request's error
        self.calls = 0
        self.oom_splits = 0  # parts split because they ran out of memory
        self.isolated = 0  # items that failed alone after a split
        self.largest_ok = 0  # the largest call (padded size) the function completed
        self.first_output_at: float | None = None  # a stream's first chunk (clock time)

    def succeeded(
        self, part: Part, output: Any, padded: int, name: str, layout: Inverse | None = None
    ) -> None:
        """Record a successful call: the function, called with `padded` items,
        returned `output`.

        Its per-item results are `split(output)` when the options have a `split`,
        else as `results_per_item` reads `output` (cut by the batch's `layout` when
        `collate` built one); one per item of `part` first (the padding's results
        after them are ignored); a result that is an exception instance is that
        item's error.

        Args:
            part: The `[start, stop)` positions the call ran.
            output: What the function returned.
            padded: The size the function was called with.
            name: The function's name, for error messages.
            layout: Where each item went in the function's argument, when `collate`
                returned one of batchkit's layouts (see `layout_of`).

        Raises:
            TypeError: The results have no `len()`, are a set, or are a `str` or
                `bytes` (one value, not a sequence of results).
            ValueError: There are not `padded` of them (by `len()` or by iterating
                them), a mapping's values disagree on the batch size, or the
                layout cannot cut the output.
        """
        if self.split is not None:
            results = self.split(output)
            layout = None  # (the user's split has made the per-item results)
        else:
            results = output
        results = results_per_item(results, layout, padded, name, per_token=self.per_token)
        start, stop = part
        chunk = list(itertools.islice(results, stop - start))
        if len(chunk) != stop - start:  # len() said otherwise: e.g. a table iterating columns
            raise ValueError(
                f"the output's len() is {padded} but iterating it yielded {len(chunk)} results"
            )
        self.largest_ok = max(self.largest_ok, padded)  # caps count what the function saw
        self.values[start:stop] = chunk
        # (Scanned in C first: a result is rarely an exception.)
        if any(map(isinstance, chunk, itertools.repeat(BaseException))):
            for i, value in enumerate(chunk, start):
                if isinstance(value, BaseException):
                    self.errors[i] = contained(value, name, f"the result for item {i}")

    def failed(self, part: Part, exc: BaseException, stage: Stage, name: str) -> None:
        """`part` raised `exc` at `stage`: split it and retry, or settle it with
        `contained(exc)` (a `SystemExit` from the user's code, say, reaches the
        callers as a `BatchInterrupted`).

        A part of more than one item is split in halves when it ran out of memory,
        when its `collate` failed, or when its call raised and `isolate_errors` is
        on (never after a `BatchTimeout`). A discarded exception's frames are
        released before the retry; after an out-of-memory failure the `on_oom` hook
        runs next.

        Args:
            part: The `[start, stop)` positions that failed.
            exc: What was raised.
            stage: Where: collating, calling, or reading the output.
            name: The function's name, for error messages.
        """
        start, stop = part
        size = stop - start
        oom = stage is Stage.CALL and self.oom.is_oom(exc)
        retry = (
            size > 1
            and not isinstance(exc, BatchTimeout)
            and (oom or stage is Stage.COLLATE or (stage is Stage.CALL and self.isolate_errors))
        )
        # A retried part's exception is discarded; a settled one is kept for its callers
        # with its traceback, but no frame of it keeps locals (tensors) alive.
        release_frames(exc, drop_traceback=retry)
        if retry:
            self.oom_splits += oom
            middle = start + (size + 1) // 2
            self.todo.append((middle, stop))
            self.todo.append((start, middle))  # popped first: keeps the input order
        else:
            if size < len(self.requests):
                self.isolated += size
            error = contained(exc, name, stage.value)
            for i in range(start, stop):
                self.errors[i] = error
        if oom:
            _run_oom_hook(self.oom)


def layout_of(argument: Any) -> Inverse | None:
    """Where each item went in a collated `argument` (a `Padded`, `Varlen`, `Packed`
    or a collator's `FeatureBatch`); None for anything else. Kept on the host: it
    holds none of the batch's arrays."""
    return argument.inverse() if isinstance(argument, Layout) else None


def results_per_item(
    output: Any,
    layout: Inverse | None,
    padded: int,
    name: str,
    verb: str = "returned",
    per_token: PerToken = None,
) -> Any:
    """What a batch function returned (or a stream yielded), as a sequence of `padded`
    per-item results.

    With a `layout`, an array, tensor or mapping of them is cut by it
    ([`Layout.split`][batchkit.Padded.split]: per-token leaves give each item its
    own steps, the rest are taken by row). Without one, a mapping whose values each
    lead with the batch dimension (`{"logits": t}`, a Hugging Face `ModelOutput`) is
    split as [`unstack`][batchkit.unstack] does. Any other sequence (a list with one
    entry per item, `batch.unpad(out)`) is taken as it is. (Iterating a mapping would
    hand out its keys, and a set its members in no order, as results.)

    Args:
        output: What the function returned.
        layout: Where each item went, or None.
        padded: The number of items the function was called with.
        name: The function's name, for error messages.
        verb: How the output came, for error messages (``"yielded"`` for a stream).
        per_token: How the layout reads each leaf (`@batched(per_token=...)`).

    Raises:
        TypeError: The results have no `len()`, are a set, or are a `str` or `bytes`.
        ValueError: There are not `padded` of them, or they cannot be split per item.
    """
    results = output
    if isinstance(results, (str, bytes, bytearray)):
        # (Indexing one would hand each caller a character, or an int.)
        raise TypeError(
            f"{name} {verb} a {type(results).__name__}, one value for the whole "
            f"batch: return a sequence of {padded} results, one per item"
        )
    if layout is not None and (is_array(results) or isinstance(results, Mapping)):
        try:
            results = split_outputs(results, layout, per_token)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}'s output cannot be split per item: {exc}") from None
    elif isinstance(results, Mapping):
        try:
            results = unstack(results)
        except ValueError as exc:
            raise ValueError(
                f"{name} {verb} a {type(results).__name__} whose values do not all "
                f"lead with the batch dimension, so it cannot be split per item: {exc}"
            ) from None
    elif isinstance(results, AbstractSet):
        raise TypeError(
            f"{name} {verb} a {type(results).__name__}, whose order is arbitrary: "
            "return a list (or a tensor) of results in the order of the items"
        )
    try:
        count = len(results)
    except TypeError:
        raise TypeError(
            f"{name} {verb} {type(results).__name__}, expected a sequence of "
            f"{padded} results (one per item)"
        ) from None
    if count != padded:
        what = "entries" if verb == "yielded" else "results"
        raise ValueError(f"{name} {verb} {count} {what} for a batch of {padded} items")
    return results


def _run_oom_hook(oom: OomRecovery) -> None:
    if oom.on_oom is not None:  # (a failing hook must not cost the callers their retry)
        run_hook(oom.on_oom, what=f"on_oom hook {oom.on_oom!r}")


def run_steps(
    requests: Sequence[Request], options: Options, name: str
) -> Generator[Any, Outcome, BatchRun]:
    """The recipe for running a batch, for both drivers.

    Each part's argument is its items collated (padded up to the policy's size by
    repeating the last item: strict sizes); a failing `collate`, call or output
    check fails or splits the part (see `BatchRun.failed`). No reference to a
    finished call's argument or outcome is kept while the next call runs (the
    driver sends the outcome straight back, too).

    Args:
        requests: The batch's requests, in batch order.
        options: The function's options (policy, `collate`, `split`, retry rules).
        name: The function's name, for error messages.

    Yields:
        Each argument to call the function with; the driver sends back the call's
        `Outcome`, `(True, output)` or `(False, exception)`.

    Returns:
        The settled run, once every request has its outcome (after any
        split-and-retry).
    """
    run = BatchRun(requests, options)
    todo, collate = run.todo, options.collate
    while todo:
        part = todo.pop()  # (left halves first)
        start, stop = part
        padded = options.policy.padded_size(stop - start)
        items = [req.item for req in requests[start:stop]]
        if padded > len(items):  # strict sizes: repeat the last item; its results are dropped
            items.extend([items[-1]] * (padded - len(items)))
        try:
            argument = collate(items) if collate is not None else items
        except BaseException as exc:  # noqa: BLE001 - a bad item must not cost the others
            run.failed(part, exc, Stage.COLLATE, name)
            continue
        del items
        layout = layout_of(argument)
        run.calls += 1
        ok, result = yield argument
        del argument
        if not ok:
            run.failed(part, result, Stage.CALL, name)
            continue
        try:
            run.succeeded(part, result, padded, name, layout)
        except BaseException as exc:  # noqa: BLE001 - e.g. a bug in split()
            run.failed(part, exc, Stage.OUTPUT, name)
        del result
    return run
