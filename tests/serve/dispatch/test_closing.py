from batchkit import DynamicBatcher
from batchkit.serve.dispatch import DispatchReason, WhenClosing, rules_for
from tests.serve.dispatch._buckets import bucket_of


def test_what_waits_leaves_at_once_while_closing():
    rule = WhenClosing()
    assert rule.reason is DispatchReason.CLOSING
    assert rule.due(bucket_of(0), limit=8, in_flight=1, now=4.0) == 4.0


def test_the_closing_rule_is_asked_only_once_closing_and_after_a_full_batch():
    policy = DynamicBatcher(4, 5)
    assert not any(isinstance(r, WhenClosing) for r in rules_for(policy, None))
    reasons = [r.reason for r in rules_for(policy, None, closing=True)]
    assert reasons[:2] == [DispatchReason.FULL, DispatchReason.CLOSING]
