"""A bucket of waiting requests for the dispatch rules' tests."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.request import new_request


def bucket_of(*arrivals: float, keys: list[float] | None = None) -> Bucket:
    """A bucket holding one waiting request admitted at each of `arrivals`."""
    bucket = Bucket(track_max_key=True)
    for i, at in enumerate(arrivals):
        key = 0.0 if keys is None else keys[i]
        bucket.append(new_request(i, key, None, 0, None, None, at))
    return bucket
