"""How a batched function is run: its options, checked in one place.

`@batched`'s options are validated here (`check_serving_options`, `oom_recovery`)
into one record (`Options`); the live settings `f.configure()` reads and changes
(`Settings`) are validated by the same checks (`check_settings`). A change is
validated whole before anything moves (a bad value changes nothing), and applies to
batches formed from then on. The policy is never changed in place (it may be shared,
e.g. by every instance of a class whose method is batched): the function gets a
changed copy (`reconfigured`).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import time
from collections.abc import Callable, Hashable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from batchkit.batchers.base import Batcher
from batchkit.batchers.checks import check_flag, duration, is_real_number, positive_count, wait_ms
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.collate.grid import collate_in_grid
from batchkit.collate.inverse import PerToken, check_per_token
from batchkit.collate.shapes import ShapeBuckets

Clock = Callable[[], float]


def empty_cuda_cache() -> None:
    """Return the failed attempt's cached blocks to the CUDA driver, if torch uses CUDA.

    The default `on_oom` hook: does nothing unless torch is imported and has already
    initialised CUDA (it never initialises CUDA itself).
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        cuda.empty_cache()


@dataclass(frozen=True)
class OomRecovery:
    """Out-of-memory handling: whether a batch that ran out of memory is split and
    retried, which exceptions mean that, and what runs before each retry.

    Attributes:
        enabled: Whether out-of-memory errors split the batch (`oom_errors=()`
            turns it off).
        extra_types: Exception types that count as out of memory beyond
            `MemoryError` and `torch.cuda.OutOfMemoryError`.
        on_oom: Called with no argument after each out-of-memory failure, before
            the retry; None for nothing.
    """

    enabled: bool = True
    extra_types: tuple[type[BaseException], ...] = ()
    on_oom: Callable[[], None] | None = empty_cuda_cache

    def is_oom(self, exc: BaseException) -> bool:
        """Whether `exc` means "this batch did not fit in memory" (and splitting is on).

        Args:
            exc: What a call of the batch function raised.
        """
        if not self.enabled:
            return False
        if isinstance(exc, (MemoryError, *self.extra_types)):
            return True
        torch = sys.modules.get("torch")  # only if the process uses torch at all
        oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        return isinstance(oom_type, type) and isinstance(exc, oom_type)


@dataclass(frozen=True)
class SessionOptions:
    """How a stateful function keeps its sessions (`@batched(state=...)`), validated.

    Attributes:
        init: Makes a session's first state: called with no argument if it can be,
            else with the session's key.
        init_takes_key: Whether `init` is called with the key.
        idle_s: Seconds after which a session with nothing queued is ended; None
            for never.
        max_sessions: The most live sessions; None for no bound.
        when_full: What a call that would start a session past `max_sessions`
            does: `"reject"` (raise `TooManySessions`) or `"block"` (wait).
        stack_states: Keep the states as rows of one stacked array
            (`StackedStates`) instead of per session objects.
    """

    init: Callable[..., Any]
    init_takes_key: bool = True
    idle_s: float | None = None
    max_sessions: int | None = None
    when_full: Literal["reject", "block"] = "reject"
    stack_states: bool = False


def _init_takes_key(init: Callable[..., Any]) -> bool:
    """Whether `init` is called with the session key: only when it cannot be called
    without an argument (so `state=dict` or a class with defaults gets none).

    Raises:
        TypeError: It takes neither no argument nor one.
    """
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):  # (a builtin without a signature: called bare)
        return False
    try:
        signature.bind()
        return False
    except TypeError:
        pass
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            f"state={init!r} must take one argument (the session key) or none"
        ) from None
    return True


def session_options(
    state: Callable[..., Any] | None,
    session_idle_s: float | None,
    max_sessions: int | None,
    when_sessions_full: str,
    stack_states: bool,
    when_full: str = "reject",
) -> SessionOptions | None:
    """`@batched`'s session options, checked; None without `state`.

    Raises:
        TypeError: `state` is not callable (or takes neither no argument nor one),
            an option has the wrong type.
        ValueError: A session option without `state`, `state` with
            `when_full="block"`, a `session_idle_s` that is not a finite number
            above 0, a `max_sessions` below 1, or an unknown `when_sessions_full`.
    """
    if state is None:
        given = (session_idle_s, max_sessions, when_sessions_full != "reject" or None, stack_states)
        if any(option is not None and option is not False for option in given):
            raise ValueError(
                "session_idle_s, max_sessions, when_sessions_full and stack_states need state="
            )
        return None
    if when_full == "block":
        raise ValueError(
            'state= does not take when_full="block": a session\'s next request is queued '
            "when its previous one settles, which must not wait for room; bound the "
            "sessions with max_sessions instead"
        )
    if not callable(state):
        raise TypeError(
            f"state must be a callable that makes a session's first state (init(key) or "
            f"init()), got {type(state).__name__}"
        )
    takes_key = _init_takes_key(state)
    if session_idle_s is not None:
        duration("session_idle_s", session_idle_s, unit="s")
    limit = positive_count("max_sessions", max_sessions, allow_none=True)
    if not isinstance(when_sessions_full, str):
        raise TypeError(
            f'when_sessions_full must be "reject" or "block", got '
            f"{type(when_sessions_full).__name__}"
        )
    if when_sessions_full not in ("reject", "block"):
        raise ValueError(
            f'when_sessions_full must be "reject" or "block", got {when_sessions_full!r}'
        )
    if when_sessions_full == "block" and max_sessions is None:
        raise ValueError('when_sessions_full="block" needs a max_sessions')
    check_flag("stack_states", stack_states)
    return SessionOptions(
        init=state,
        init_takes_key=takes_key,
        idle_s=None if session_idle_s is None else float(session_idle_s),
        max_sessions=limit,
        when_full=when_sessions_full,  # type: ignore[arg-type]
        stack_states=stack_states,
    )


@dataclass(frozen=True)
class Options:
    """How a batched function is run: the options of
    [`batched`][batchkit.serve.batched.batched], validated.

    Attributes:
        policy: The batching policy.
        collate: Builds the function's argument from the list of items (None: the
            list).
        split: Turns the function's output into per-item results (None: the output).
        max_queue_size: How many requests may wait; None for no bound.
        max_concurrent_batches: How many batches may run at once.
        clock: The monotonic clock, in seconds.
        oom: Out-of-memory handling.
        isolate_errors: Re-run a failing batch in halves to find the failing items.
        when_full: What a call does on a full queue: `"reject"` or `"block"`.
        streaming: The function is a generator (or async generator) function.
        batch_timeout: Seconds one call of the function may run; None for no bound.
        max_latency_s: Each request's latency target, from admission to result, in
            seconds (`max_latency_ms` / 1000); None for none.
        coalesce: Identical requests computed once: False, True (the item is the
            key) or the key function (see `batchkit.serve.coalesce`).
        cache: The mapping that keeps results by the same key; None for none.
        per_token: How a layout's inverse reads the output's leaves (see
            [`split`][batchkit.Padded.split]); None: by their shapes.
        sessions: A stateful function's session options (`state=`); None for a
            stateless one.
    """

    policy: Batcher
    collate: Callable[[list[Any]], Any] | None = None
    split: Callable[[Any], Sequence[Any]] | None = None
    max_queue_size: int | None = None
    max_concurrent_batches: int = 1
    clock: Clock = time.monotonic
    oom: OomRecovery = field(default_factory=OomRecovery)
    isolate_errors: bool = False
    when_full: Literal["reject", "block"] = "reject"
    streaming: bool = False
    batch_timeout: float | None = None
    max_latency_s: float | None = None
    coalesce: bool | Callable[[Any], Hashable] = False
    cache: MutableMapping[Hashable, Any] | None = None
    per_token: PerToken = None
    sessions: SessionOptions | None = None

    def __post_init__(self) -> None:
        # The counts are stored as ints whatever number type they came as (a YAML or
        # JSON config gives 4.0): every later comparison and report sees an int.
        queue = positive_count("max_queue_size", self.max_queue_size, allow_none=True)
        concurrent = positive_count("max_concurrent_batches", self.max_concurrent_batches)
        object.__setattr__(self, "max_queue_size", queue)  # frozen: set once, here
        object.__setattr__(self, "max_concurrent_batches", concurrent)
        check_per_token(self.per_token, "@batched")


OnOom = Callable[[], None]


def oom_recovery(
    oom_errors: type[BaseException] | tuple[type[BaseException], ...] | None,
    on_oom: OnOom | Literal[False] | None,
) -> OomRecovery:
    """The out-of-memory handling `@batched`'s two options ask for.

    Args:
        oom_errors: None (the default) for the built-in out-of-memory types; extra
            types (a tuple, or one type) are added to them; `()` turns splitting
            off.
        on_oom: None for the default hook (`empty_cuda_cache`); False for none; else
            the callable to run.

    Raises:
        TypeError: `on_oom` is not callable, None or False, or `oom_errors` holds
            something that is not an exception type.
    """
    if on_oom is not None and on_oom is not False and not callable(on_oom):
        raise TypeError(f"on_oom must be callable, None or False, got {type(on_oom).__name__}")
    hook = empty_cuda_cache if on_oom is None else (on_oom or None)
    if oom_errors is None:
        return OomRecovery(on_oom=hook)
    if isinstance(oom_errors, type):
        oom_errors = (oom_errors,)
    if not isinstance(oom_errors, (tuple, list)):
        raise TypeError(
            f"oom_errors must be an exception type or a tuple of them, got "
            f"{type(oom_errors).__name__}"
        )
    for t in oom_errors:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"oom_errors must hold exception types, got {t!r}")
    return OomRecovery(enabled=len(oom_errors) > 0, extra_types=tuple(oom_errors), on_oom=hook)


def policy_of(
    batcher: Batcher | None,
    max_batch_size: int | None,
    max_wait_ms: float | None,
    group: Callable[[Any], Hashable] | None,
    max_groups_per_batch: int | None,
    shapes: ShapeBuckets | None = None,
) -> Batcher:
    """`@batched`'s policy: `batcher`, or the default `DynamicBatcher` of the sizes,
    wait, group and shape grid given to the decorator (which then go nowhere else;
    the grid's largest batch size is the default `max_batch_size`).

    Raises:
        ValueError: `batcher` and any of the others, which belong to the batcher
            (`shapes` beside a batcher that has other shapes, or none).
        TypeError: `batcher` is not a batchkit `Batcher`.
    """
    if shapes is not None and not isinstance(shapes, ShapeBuckets):
        raise TypeError(f"shapes must be a ShapeBuckets, got {type(shapes).__name__}")
    if batcher is None:
        default_size = 32 if shapes is None else shapes.max_batch_size
        return DynamicBatcher(
            default_size if max_batch_size is None else max_batch_size,
            5.0 if max_wait_ms is None else max_wait_ms,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
            shapes=shapes,
        )
    if shapes is not None and batcher.shapes != shapes:
        raise ValueError(
            f"shapes={shapes!r} but the batcher has shapes={batcher.shapes!r}: give the "
            "grid to the batcher alone (@batched then reads it from there)"
        )
    if max_batch_size is not None or max_wait_ms is not None:
        raise ValueError("pass max_batch_size/max_wait_ms to the batcher, not to @batched")
    if group is not None or max_groups_per_batch is not None:
        raise ValueError(
            "pass group/max_groups_per_batch to the batcher (every policy takes them), "
            "not to @batched"
        )
    if not isinstance(batcher, Batcher):
        raise TypeError(f"batcher must be a batchkit Batcher, got {type(batcher).__name__}")
    return batcher


def check_serving_options(
    max_queue_size: int | None,
    max_concurrent_batches: int,
    when_full: str,
    batch_timeout: float | None,
    max_latency_ms: float | None = None,
    isolate_errors: bool = False,
    clock: Clock | None = None,
) -> None:
    """Raise, naming the first option of `@batched` that is not valid.

    Args:
        max_queue_size: A positive int, or None.
        max_concurrent_batches: A positive int.
        when_full: `"reject"` or `"block"` (which needs a `max_queue_size`).
        batch_timeout: A number of seconds above 0 that timers take
            (`threading.TIMEOUT_MAX` at most), or None.
        max_latency_ms: A number of milliseconds above 0 that timers take, or None.
        isolate_errors: True or False.
        clock: A callable, or None.

    Raises:
        TypeError: An option has the wrong type (a string for a number, a number
            for `when_full`, something else than a bool for `isolate_errors`, a
            `clock` that is not callable).
        ValueError: An option has the right type and a value out of range.
    """
    # (Checked here to name the option first; `Options` stores them as ints.)
    positive_count("max_queue_size", max_queue_size, allow_none=True)
    positive_count("max_concurrent_batches", max_concurrent_batches)
    if not isinstance(when_full, str):
        raise TypeError(
            f'when_full must be "reject" or "block", got {type(when_full).__name__} {when_full!r}'
        )
    if when_full not in ("reject", "block"):
        raise ValueError(f'when_full must be "reject" or "block", got {when_full!r}')
    if when_full == "block" and max_queue_size is None:
        raise ValueError('when_full="block" needs a max_queue_size')
    if batch_timeout is not None:
        duration("batch_timeout", batch_timeout, unit="s")
    check_latency_target(max_latency_ms)
    check_flag("isolate_errors", isolate_errors)
    if clock is not None and not callable(clock):
        raise TypeError(f"clock must be callable, got {type(clock).__name__}")


@dataclass(frozen=True)
class Settings:
    """The settings in force for one batched function (see
    [`configure`][batchkit.BatchedFunction.configure]).

    Attributes:
        max_batch_size: The largest batch the policy forms.
        max_wait_ms: How long a batch may wait to fill, in milliseconds; None for a
            policy without one ([`StaticBatcher`][batchkit.StaticBatcher] waits until
            full).
        max_concurrent_batches: Batches that may run at once.
        max_queue_size: Requests that may wait; None for no bound.
        max_latency_ms: Each request's latency target, in milliseconds; None for
            none.
    """

    max_batch_size: int
    max_wait_ms: float | None
    max_concurrent_batches: int
    max_queue_size: int | None
    max_latency_ms: float | None = None


@dataclass(frozen=True)
class SettingsChange:
    """What one `f.configure(...)` asks to change: each field None is left as it is
    (the fields are those of `Settings`)."""

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    max_concurrent_batches: int | None = None
    max_queue_size: int | None = None
    max_latency_ms: float | None = None


def read_settings(
    policy: Batcher,
    max_concurrent_batches: int,
    max_queue_size: int | None,
    max_latency_s: float | None = None,
) -> Settings:
    """The settings of `policy` and the queue, as [`Settings`][batchkit.Settings].

    Args:
        policy: The policy in force.
        max_concurrent_batches: Batches that may run at once.
        max_queue_size: Requests that may wait; None for no bound.
        max_latency_s: The latency target, in seconds; None for none.
    """
    wait = policy.max_wait_s
    return Settings(
        max_batch_size=policy.max_batch_size,
        max_wait_ms=None if wait is None else wait * 1000.0,
        max_concurrent_batches=max_concurrent_batches,
        max_queue_size=max_queue_size,
        max_latency_ms=None if max_latency_s is None else max_latency_s * 1000.0,
    )


def check_settings(
    max_batch_size: int | None,
    max_wait_ms: float | None,
    max_concurrent_batches: int | None,
    max_queue_size: int | None,
    max_latency_ms: float | None = None,
) -> tuple[int | None, float | None, int | None, int | None, float | None]:
    """Raise, naming the setting, for a value no policy could take.

    Args:
        max_batch_size: A positive int (or a whole-number float such as `8.0`, as a
            YAML or JSON config gives it: `reconfigured` stores it as an int), or
            None (not changed).
        max_wait_ms: A finite number of milliseconds >= 0, or None.
        max_concurrent_batches: A positive int, or None.
        max_queue_size: A positive int, or None.
        max_latency_ms: A finite number of milliseconds > 0, or None.

    Returns:
        The settings in the order given, the counts as ints (`8.0` becomes `8`):
        the values to store.

    Raises:
        TypeError: A setting is not a number.
        ValueError: A setting is a number out of its range (a wait or target
            longer than `threading.TIMEOUT_MAX` seconds among them).
    """
    batch = positive_count("max_batch_size", max_batch_size, allow_none=True)
    concurrent = positive_count("max_concurrent_batches", max_concurrent_batches, allow_none=True)
    queue = positive_count("max_queue_size", max_queue_size, allow_none=True)
    max_wait_ms = wait_ms("max_wait_ms", max_wait_ms, allow_none=True)
    check_latency_target(max_latency_ms)
    return batch, max_wait_ms, concurrent, queue, max_latency_ms


def check_latency_target(max_latency_ms: float | None) -> None:
    """Raise unless `max_latency_ms` is None or a number of milliseconds timers take.

    Args:
        max_latency_ms: A latency target in milliseconds, or None.

    Raises:
        TypeError: It is not a number.
        ValueError: It is not above 0, is not finite, or is longer than
            `threading.TIMEOUT_MAX` seconds.
    """
    if max_latency_ms is not None:
        duration("max_latency_ms", max_latency_ms, unit="ms")


def is_positive_finite(value: object) -> bool:
    """Whether `value` is a real number (not a bool) in (0, inf).

    Args:
        value: Any value.
    """
    return is_real_number(value) and 0 < value < math.inf  # type: ignore[operator]


def check_has_wait(policy: Batcher, max_wait_ms: float | None) -> None:
    """Raise ValueError, naming the policy, when a wait is given to one that has none.

    Args:
        policy: The policy the wait is for.
        max_wait_ms: The wait given, in milliseconds; None (none given) always passes.

    Raises:
        ValueError: `max_wait_ms` is given and the policy waits until a batch is full
            ([`StaticBatcher`][batchkit.StaticBatcher]): silently ignoring it would
            leave the user believing in a bound that does not exist.
    """
    if max_wait_ms is not None and policy.max_wait_s is None:
        raise ValueError(
            f"{type(policy).__name__} has no max_wait_ms: it waits until a batch is full"
        )


def reconfigured(policy: Batcher, max_batch_size: int | None, max_wait_ms: float | None) -> Batcher:
    """A copy of `policy` with the given settings (the same object if none is given).

    Args:
        policy: The policy in force (never changed in place: it may be shared).
        max_batch_size: Its new largest batch (a whole-number float is stored as an
            int); None leaves it.
        max_wait_ms: Its new longest wait, in milliseconds; None leaves it.

    Raises:
        ValueError: The policy has no `max_wait_ms` (it waits until full), or
            `max_batch_size` exceeds its largest preferred batch size.
    """
    if max_batch_size is None and max_wait_ms is None:
        return policy
    max_batch_size = positive_count("max_batch_size", max_batch_size, allow_none=True)
    kind = type(policy).__name__
    check_has_wait(policy, max_wait_ms)
    sizes: tuple[int, ...] = getattr(policy, "preferred_batch_sizes", ())
    if policy.shapes is not None:
        sizes = policy.shapes.batch_sizes
    if max_batch_size is not None and sizes and max_batch_size > sizes[-1]:
        raise ValueError(
            f"max_batch_size={max_batch_size} exceeds the largest of {kind}'s "
            f"preferred_batch_sizes {list(sizes)}"
        )
    changed = copy.copy(policy)
    if max_batch_size is not None:
        changed.max_batch_size = max_batch_size
    if max_wait_ms is not None:
        changed.max_wait_s = max_wait_ms / 1000.0
    return changed


def collate_and_policy(
    policy: Batcher, collate: Callable[[list[Any]], Any] | None
) -> tuple[Batcher, Callable[[list[Any]], Any] | None]:
    """The policy and collate a function runs with, made to agree: under the
    policy's shape grid, `collate` pads to its cells (`collate_in_grid`); and a
    policy whose length key was not chosen reads it from a collator that has
    `length_of` (a `PadCollator`: dict features need no `key=`), so the bucket a
    request joins and the length it is padded to come from one value.

    Args:
        policy: The function's policy (never changed in place: a copy is returned).
        collate: The function's collate, or None.

    Raises:
        ValueError: `collate` is a collator with shapes other than the policy's.
    """
    collate = collate_in_grid(collate, policy.shapes)
    length_of = getattr(collate, "length_of", None)
    if policy.key is not None and not policy.key_given and callable(length_of):
        policy = copy.copy(policy)
        policy.key = length_of
    return policy, collate
