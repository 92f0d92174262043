from batchkit import DynamicBatcher
from batchkit.serve.dispatch import DispatchReason, WhenFull
from tests.serve.dispatch._buckets import bucket_of


def test_a_bucket_at_its_limit_leaves_now_and_one_below_it_waits_for_arrivals():
    rule = WhenFull(DynamicBatcher(4, 5))
    assert rule.reason is DispatchReason.FULL
    assert rule.due(bucket_of(0, 0, 0, 0), limit=4, in_flight=1, now=7.0) == 7.0
    assert rule.due(bucket_of(0, 0, 0), limit=4, in_flight=1, now=7.0) is None


def test_a_learned_limit_below_the_policy_size_counts_as_full():
    rule = WhenFull(DynamicBatcher(8, 5))
    assert rule.due(bucket_of(0, 0), limit=2, in_flight=0, now=1.0) == 1.0


def test_waiting_requests_whose_cost_reaches_the_token_budget_are_full():
    rule = WhenFull(DynamicBatcher(8, 5, max_tokens=100))
    # padded cost: 3 requests of key 40 -> 3 * 40 = 120 >= 100
    assert rule.due(bucket_of(0, 0, 0, keys=[40, 10, 40]), limit=8, in_flight=1, now=2.0) == 2.0
    assert rule.due(bucket_of(0, 0, keys=[40, 10]), limit=8, in_flight=1, now=2.0) is None
