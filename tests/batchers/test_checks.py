"""Counts: ints and whole-number floats (as YAML and JSON configs give them) are taken
and stored as ints; other floats and numbers below 1 are refused by name with a
ValueError, bools, strings and None with a TypeError. Waits: one check for a policy and
a live change, up to what the platform's timers take."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchkit
from batchkit import DynamicBatcher
from batchkit.batchers.checks import check_positive_int, positive_count, wait_ms


@pytest.mark.parametrize("value", [1, 4, 4.0, 1.0, np.float32(8), np.int64(3), 2.0**60])
def test_a_whole_number_is_taken_as_a_plain_int(value: object) -> None:
    count = positive_count("max_batch_size", value)
    assert type(count) is int and count == value


@pytest.mark.parametrize("value", [1.5, 0.0, -2.0, 0, math.nan, math.inf, np.float64(2.5)])
def test_a_number_that_is_not_a_positive_whole_one_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError, match=r"max_batch_size must be a positive int .* got "):
        positive_count("max_batch_size", value)


@pytest.mark.parametrize("value", [True, False, "4", None, [4], b"4"])
def test_what_is_not_a_number_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"max_batch_size must be a positive int, got \w+ "):
        positive_count("max_batch_size", value)


def test_none_passes_only_when_allowed() -> None:
    assert positive_count("max_queue_size", None, allow_none=True) is None
    with pytest.raises(TypeError, match="max_queue_size"):
        positive_count("max_queue_size", None)


def test_the_refusal_quotes_the_value_given() -> None:
    with pytest.raises(ValueError, match=r"got 0\.0$"):
        positive_count("max_batch_size", 0.0)


@given(st.integers(min_value=1, max_value=2**53))
def test_an_int_and_its_float_give_the_same_count(n: int) -> None:
    assert positive_count("n", n) == positive_count("n", float(n)) == n


def test_the_strict_check_still_takes_ints_only() -> None:
    check_positive_int("window", 3)
    with pytest.raises(TypeError, match="window must be a positive int"):
        check_positive_int("window", 3.0)
    with pytest.raises(ValueError, match="window must be a positive int"):
        check_positive_int("window", 0)


def test_every_policy_takes_its_counts_as_whole_number_floats_and_stores_ints() -> None:
    import batchkit

    policies = [
        batchkit.DynamicBatcher(8.0, preferred_batch_sizes=[4.0, 8.0]),  # type: ignore[arg-type]
        batchkit.StaticBatcher(8.0),  # type: ignore[arg-type]
        batchkit.SortedBatcher(key=len, batch_size=8.0, window=64.0),  # type: ignore[arg-type]
        batchkit.BucketedBatcher([4, 8], key=len, max_batch_size=8.0, max_tokens=64.0),  # type: ignore[arg-type]
        batchkit.PackingBatcher(max_tokens=64.0, max_batch_size=8.0),  # type: ignore[arg-type]
    ]
    for policy in policies:
        assert type(policy.max_batch_size) is int and policy.max_batch_size == 8, policy
    assert type(policies[3].max_tokens) is int and type(policies[4].max_tokens) is int
    boundaries = batchkit.BucketedBatcher.from_sample([1, 2, 3, 4, 5, 6, 7, 8], num_buckets=4.0)  # type: ignore[arg-type]
    assert len(boundaries.boundaries) == 4
    with pytest.raises(ValueError, match="max_batch_size must be a positive int"):
        batchkit.DynamicBatcher(8.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 1e300])
def test_a_wait_is_a_finite_number_of_at_least_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="max_wait_ms"):
        wait_ms("max_wait_ms", bad)


@pytest.mark.parametrize("bad", [True, False, "5", None])
def test_a_wait_is_a_number_never_a_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="max_wait_ms"):
        wait_ms("max_wait_ms", bad)


def test_a_policy_and_a_live_change_refuse_the_same_waits() -> None:
    for bad, error in ((True, TypeError), (-1.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="max_wait_ms"):
            DynamicBatcher(4, bad)  # type: ignore[arg-type]
        f = batchkit.batched(lambda xs: xs)
        with pytest.raises(error, match="max_wait_ms"):
            f.configure(max_wait_ms=bad)
    assert wait_ms("max_wait_ms", 0) == 0.0 and wait_ms("w", None, allow_none=True) is None
