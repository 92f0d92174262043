from batchkit.serve.dispatch import DispatchReason, WhenIdle
from tests.serve.dispatch._buckets import bucket_of


def test_a_partial_batch_leaves_at_once_only_while_nothing_runs():
    rule = WhenIdle()
    assert rule.reason is DispatchReason.IDLE
    assert rule.due(bucket_of(0), limit=8, in_flight=0, now=3.0) == 3.0
    assert rule.due(bucket_of(0), limit=8, in_flight=1, now=3.0) is None
