from batchkit.serve.dispatch import AfterMaxWait, DispatchReason
from tests.serve.dispatch._buckets import bucket_of


def test_the_batch_is_due_when_its_oldest_request_has_waited_the_max_wait():
    rule = AfterMaxWait(0.005)
    assert rule.reason is DispatchReason.MAX_WAIT
    assert rule.due(bucket_of(1.0, 2.0, 3.0), limit=8, in_flight=1, now=1.0) == 1.005
