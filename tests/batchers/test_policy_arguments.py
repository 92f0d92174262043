"""Every argument of every policy's constructor is checked: a value of the wrong type
raises TypeError, a value of the right type out of its range ValueError, both naming
the argument. The tables below must name every parameter of every policy exported
from `batchkit.batchers` (read with `inspect`), so a new argument or a new policy
cannot go unchecked."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import batchkit.batchers
from batchkit.batchers import Batcher


def by_task(item: Any) -> str:
    return "task"


# What each policy needs to be built at all, beside the argument under test.
REQUIRED: dict[str, dict[str, Any]] = {
    "Batcher": {"max_batch_size": 8, "max_wait_ms": 5.0},
    "StaticBatcher": {"batch_size": 8},
    "DynamicBatcher": {},
    "BucketedBatcher": {"boundaries": [8, 16]},
    "SortedBatcher": {},
    "PackingBatcher": {"max_tokens": 64},
}
# Arguments that only mean something beside another one.
NEEDS: dict[str, dict[str, Any]] = {"max_groups_per_batch": {"group": by_task}}
# A value of the wrong type for each argument, by name.
WRONG_TYPE: dict[str, object] = {
    "batch_size": "8",
    "max_batch_size": "8",
    "max_wait_ms": "5",
    "max_tokens": True,
    "key": 5,
    "cost": 5,
    "group": "task",
    "max_groups_per_batch": "2",
    "drop_last": "no",
    "preferred_batch_sizes": 8,
    "strict_sizes": 1,
    "eager": "yes",
    "boundaries": 16,
    "window": [64],
    "shapes": (8, 16),
}
# A value of the right type out of its range, by name; None: every value of the right
# type is valid (a callable, a flag).
WRONG_VALUE: dict[str, object] = {
    "batch_size": 0,
    "max_batch_size": 2.5,
    "max_wait_ms": 1e300,  # longer than the platform's timers take
    "max_tokens": -1,
    "key": None,
    "cost": "area",
    "group": None,
    "max_groups_per_batch": 0,
    "drop_last": None,
    "preferred_batch_sizes": [0],
    "strict_sizes": None,
    "eager": None,
    "boundaries": [16, 8],
    "window": 0,
    "shapes": None,  # every ShapeBuckets is valid (its own arguments are checked in it)
}


def policies() -> list[type[Batcher]]:
    """Every policy class `batchkit.batchers` exports."""
    exported = (getattr(batchkit.batchers, name) for name in batchkit.batchers.__all__)
    return [c for c in exported if isinstance(c, type) and issubclass(c, Batcher)]


def arguments() -> list[tuple[type[Batcher], str]]:
    return [
        (policy, name) for policy in policies() for name in inspect.signature(policy).parameters
    ]


def build(policy: type[Batcher], name: str, value: object) -> Batcher:
    options = {**REQUIRED[policy.__name__], **NEEDS.get(name, {}), name: value}
    return policy(**options)


def test_the_tables_cover_every_policy_and_every_argument() -> None:
    assert {p.__name__ for p in policies()} == set(REQUIRED)
    names = {name for _, name in arguments()}
    assert names == set(WRONG_TYPE) == set(WRONG_VALUE)


@pytest.mark.parametrize(("policy", "name"), arguments(), ids=lambda x: getattr(x, "__name__", x))
def test_a_wrong_type_is_a_type_error_naming_the_argument(policy: type[Batcher], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        build(policy, name, WRONG_TYPE[name])


@pytest.mark.parametrize(
    ("policy", "name"),
    [(policy, name) for policy, name in arguments() if WRONG_VALUE[name] is not None],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_a_wrong_value_is_a_value_error_naming_the_argument(
    policy: type[Batcher], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        build(policy, name, WRONG_VALUE[name])


def test_the_base_arguments_build_every_policy() -> None:
    for policy in policies():
        assert isinstance(policy(**REQUIRED[policy.__name__]), policy)
