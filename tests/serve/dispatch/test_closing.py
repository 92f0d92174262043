from batchkit.serve.dispatch import DispatchReason, WhenClosing
from tests.serve.dispatch._buckets import bucket_of


def test_what_waits_leaves_at_once_once_closing_and_not_before():
    rule = WhenClosing()
    assert rule.reason is DispatchReason.CLOSING
    assert rule.due(bucket_of(0), limit=8, in_flight=1, now=4.0) is None
    rule.closing = True
    assert rule.due(bucket_of(0), limit=8, in_flight=1, now=4.0) == 4.0
