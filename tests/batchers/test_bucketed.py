"""BucketedBatcher's boundaries: what they must be, and the error naming a bad one.

(How items land in buckets, offline and through a sampler, is in test_offline.py and
test_sampler.py.)"""

from __future__ import annotations

import pytest

from batchkit import BucketedBatcher


@pytest.mark.parametrize(
    ("boundaries", "match"),
    [
        ([10, float("nan"), 30], r"boundaries\[1\] must be a number, got nan"),
        (["a", "b"], r"boundaries\[0\] must be a number, got 'a'"),
        ([1, None], r"boundaries\[1\] must be a number, got None"),
        ([True, 5], r"boundaries\[0\]"),
    ],
)
def test_bucket_boundaries_must_be_numbers(boundaries: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketedBatcher(boundaries)


def test_boundaries_must_be_iterable() -> None:
    with pytest.raises(TypeError, match="boundaries must be an iterable of numbers, got int"):
        BucketedBatcher(5)  # type: ignore[arg-type]
