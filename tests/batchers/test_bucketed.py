"""BucketedBatcher's boundaries: what they must be, and the error naming a bad one.

(How items land in buckets, offline and through a sampler, is in test_offline.py and
test_sampler.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from batchkit import BucketedBatcher


@pytest.mark.parametrize(
    ("boundaries", "error", "match"),
    [
        ([10, float("nan"), 30], ValueError, r"boundaries\[1\] must be a number, got nan"),
        (["a", "b"], TypeError, r"boundaries\[0\] must be a number, got str 'a'"),
        ([1, None], TypeError, r"boundaries\[1\] must be a number, got NoneType None"),
        ([True, 5], TypeError, r"boundaries\[0\]"),
    ],
)
def test_bucket_boundaries_must_be_numbers(
    boundaries: list, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        BucketedBatcher(boundaries)


def test_boundaries_must_be_iterable() -> None:
    with pytest.raises(TypeError, match="boundaries must be an iterable of numbers, got int"):
        BucketedBatcher(5)  # type: ignore[arg-type]


def test_from_sample_puts_boundaries_at_the_samples_quantiles() -> None:
    lengths = np.random.default_rng(0).lognormal(5, 1, 20_000).astype(int) + 1
    policy = BucketedBatcher.from_sample(lengths, num_buckets=8, max_tokens=8192)
    assert policy.max_tokens == 8192 and len(policy.boundaries) == 8
    assert policy.boundaries[-1] == lengths.max()
    share = np.bincount([policy.bucket_of(k) for k in lengths.tolist()]) / len(lengths)
    # each bucket about an eighth of the items (ties at a boundary move it a little)
    assert np.all(np.abs(share - 1 / 8) < 0.01), share
    by_tokens = BucketedBatcher.from_lengths(lengths, num_buckets=8)
    assert by_tokens.boundaries != policy.boundaries  # that one balances tokens instead


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_buckets": 0}, "num_buckets must be a positive int"),
        ({"num_buckets": 5}, "needs at least that many distinct lengths"),
        ({"num_buckets": 2, "max_tokens": 0}, "max_tokens must be a positive int"),
    ],
)
def test_from_sample_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketedBatcher.from_sample([3, 3, 7, 9], **kwargs)
