from batchkit import DynamicBatcher
from batchkit.serve.dispatch import BeforeDeadline, DispatchReason
from batchkit.serve.request import new_request
from batchkit.serve.targets import LatencyTarget
from tests.serve.dispatch._buckets import bucket_of


def _taught(target: LatencyTarget, seconds: float, batches: int = 8) -> None:
    for k in range(batches):
        reqs = [new_request(0, 0.0, None, 0) for _ in range(4)]
        target.finished(reqs, 4, seconds, None, (k + 1) * seconds, clean=True)


def test_no_deadline_binds_while_the_model_is_still_learning():
    rule = BeforeDeadline(LatencyTarget(0.1, DynamicBatcher(8, 50)))
    assert rule.reason is DispatchReason.DEADLINE
    assert rule.due(bucket_of(0.0), limit=8, in_flight=1, now=0.0) is None


def test_a_ready_model_makes_the_batch_due_before_its_oldest_request_would_be_late():
    target = LatencyTarget(0.1, DynamicBatcher(8, 50))
    _taught(target, 0.02)
    bucket = bucket_of(0.0, 0.01)
    for req in bucket.candidates(None):
        target.set_deadline(req)
    due = BeforeDeadline(target).due(bucket, limit=8, in_flight=1, now=0.0)
    assert due is not None
    assert 0.0 < due < 0.1  # before the oldest request's deadline, less the batch's time
