"""Grouped batching offline, in samplers and in streams: every batch within its group limit
(`max_groups_per_batch`, 1 by default), the policy's own rules within a group, and clear
errors for a bad group function, a bad limit or groups that do not match the lengths."""

from __future__ import annotations

import bisect
import copy
import pickle
import sys
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, DynamicBatcher, PackingBatcher, SortedBatcher, StaticBatcher
from batchkit.batchers.base import Batcher
from batchkit.serve.options import reconfigured
from tests.batchers._costs import costs, within_budget

Item = tuple[int, Hashable]  # (length, group)

# Distinct under ==, of several kinds: any hashable is a group.
GROUP_VALUES: list[Hashable] = [
    "en", "fr", None, 0, ("lora", 1), frozenset({"x"}), 2.5, "de", b"raw", 7, ("lora", 2), "es",
]  # fmt: skip


def length(item: Item) -> int:
    return item[0]


def task(item: Item) -> Hashable:
    return item[1]


@st.composite
def grouped_items(draw: st.DrawFn, max_size: int = 80) -> list[Item]:
    """Items of random lengths in one to twelve groups (one group, or many)."""
    num_groups = draw(st.sampled_from([1, 2, 3, 12]))
    values = GROUP_VALUES[:num_groups]
    return draw(st.lists(st.tuples(st.integers(0, 64), st.sampled_from(values)), max_size=max_size))


@st.composite
def grouped_policies(draw: st.DrawFn, packing: bool = True) -> Batcher:
    """Every kind of policy, with random limits, grouped by `task`, with a random limit
    on groups per batch (None: the default, 1)."""
    size = draw(st.integers(1, 9))
    budget = draw(st.none() | st.integers(1, 256))
    groups: dict[str, Any] = {
        "group": task,
        "max_groups_per_batch": draw(st.none() | st.integers(1, 4)),
    }
    kinds = ["static", "dynamic", "bucketed", "sorted"] + (["packing"] if packing else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "static":
        return StaticBatcher(size, **groups)
    if kind == "dynamic":
        return DynamicBatcher(size, max_tokens=budget, key=length, cost=draw(costs), **groups)
    if kind == "bucketed":
        bounds = sorted(draw(st.lists(st.integers(1, 64), min_size=1, max_size=4, unique=True)))
        return BucketedBatcher(
            bounds, key=length, max_batch_size=size, max_tokens=budget, cost=draw(costs), **groups
        )
    if kind == "sorted":
        window = draw(st.none() | st.integers(1, 20))
        return SortedBatcher(
            key=length, batch_size=size, max_tokens=budget, window=window, cost=draw(costs),
            **groups,
        )  # fmt: skip
    limit = draw(st.none() | st.integers(1, 9))
    return PackingBatcher(budget or 64, key=length, max_batch_size=limit, **groups)


def ungrouped(policy: Batcher) -> Batcher:
    """The same policy without its group (its other options as they are)."""
    plain = copy.copy(policy)
    plain.group = plain.max_groups_per_batch = None
    return plain


def check_batch(policy: Batcher, batch: Sequence[Item]) -> None:
    """A batch within the policy's limits: size, budget, bucket and groups."""
    assert 1 <= len(batch) <= policy.max_batch_size
    lengths = [n for n, _ in batch]
    assert within_budget(policy, lengths)
    if isinstance(policy, BucketedBatcher):
        assert len({bisect.bisect_left(policy.boundaries, n) for n in lengths}) == 1
    assert policy.max_groups_per_batch is not None
    assert len({g for _, g in batch}) <= policy.max_groups_per_batch


def first_seen(values: Sequence[Hashable]) -> list[Hashable]:
    return list(dict.fromkeys(values))


# -- offline ------------------------------------------------------------------------
@given(grouped_items(), grouped_policies())
def test_every_batch_keeps_its_group_limit_and_every_item_goes_once(
    items: list[Item], policy: Batcher
) -> None:
    batches = list(policy.batches(items))
    assert sorted(i for b in batches for i in b.indices) == list(range(len(items)))
    for b in batches:
        assert list(b) == [items[i] for i in b.indices]
        check_batch(policy, b)


@given(grouped_items(), grouped_policies())
def test_each_pool_of_groups_is_batched_as_the_policy_batches_it_alone(
    items: list[Item], policy: Batcher
) -> None:
    # the pools: max_groups_per_batch consecutive groups in order of first appearance,
    # their items group after group; each pool's batches as the ungrouped policy cuts them
    k = policy.max_groups_per_batch
    assert k is not None
    order = first_seen([g for _, g in items])
    expected: list[list[int]] = []
    for start in range(0, len(order), k):
        pool = [i for g in order[start : start + k] for i, (_, h) in enumerate(items) if h == g]
        alone = ungrouped(policy).batches([items[i] for i in pool])
        expected += [[pool[j] for j in b.indices] for b in alone]
    assert [b.indices for b in policy.batches(items)] == expected


@given(grouped_items(), grouped_policies())
def test_one_group_a_batch_gives_each_groups_batches_in_order_of_first_appearance(
    items: list[Item], policy: Batcher
) -> None:
    policy.max_groups_per_batch = 1
    each = [task(b[0]) for b in policy.batches(items)]  # a batch's one group
    runs = [g for i, g in enumerate(each) if i == 0 or g != each[i - 1]]
    assert runs == first_seen([g for _, g in items])  # one run per group, in that order


def test_the_issue_example_one_task_per_batch() -> None:
    items = [(3, "qa"), (5, "sum"), (4, "qa"), (2, "sum"), (1, "qa")]
    policy = DynamicBatcher(16, 5, group=task)
    assert [b.indices for b in policy.batches(items)] == [[0, 2, 4], [1, 3]]
    two = DynamicBatcher(2, 5, group=task, max_groups_per_batch=2)
    # a pool of both tasks, task after task: the qa tail fills up with a sum item
    assert [b.indices for b in two.batches(items)] == [[0, 2], [4, 1], [3]]


def test_static_drop_last_drops_each_pools_short_batch() -> None:
    items = [(1, "a")] * 5 + [(1, "b")] * 3
    policy = StaticBatcher(2, drop_last=True, group=task)
    assert [b.indices for b in policy.batches(items)] == [[0, 1], [2, 3], [5, 6]]


def test_without_group_nothing_changes() -> None:
    policy = DynamicBatcher(4)
    assert policy.group is None and policy.max_groups_per_batch is None
    assert policy.group_of((1, "a")) is None
    assert policy.groups_of([(1, "a"), (2, "b")]) == [None, None]
    assert "group" not in repr(policy)
    assert [b.indices for b in policy.batches([(1, "a"), (2, "b")])] == [[0, 1]]


# -- the options ----------------------------------------------------------------------
ALL_POLICIES = {
    "static": lambda **kw: StaticBatcher(4, **kw),
    "dynamic": lambda **kw: DynamicBatcher(4, **kw),
    "bucketed": lambda **kw: BucketedBatcher([4, 8], **kw),
    "sorted": lambda **kw: SortedBatcher(**kw),
    "packing": lambda **kw: PackingBatcher(64, **kw),
    "base": lambda **kw: Batcher(max_batch_size=4, max_wait_ms=1.0, **kw),
}


@pytest.mark.parametrize("make", ALL_POLICIES.values(), ids=ALL_POLICIES.keys())
def test_every_policy_takes_group_and_defaults_to_one_group_a_batch(make: Any) -> None:
    policy = make(group=task)
    assert policy.group is task and policy.max_groups_per_batch == 1
    assert make(group=task, max_groups_per_batch=3).max_groups_per_batch == 3
    whole = make(group=task, max_groups_per_batch=4.0).max_groups_per_batch
    assert whole == 4 and type(whole) is int  # from a YAML or JSON config


@pytest.mark.parametrize("make", ALL_POLICIES.values(), ids=ALL_POLICIES.keys())
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (4.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("4", TypeError),
    ],
)
def test_a_limit_that_is_not_a_whole_number_of_at_least_one_is_refused(
    make: Any, bad: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=r"max_groups_per_batch must be a positive int"):
        make(group=task, max_groups_per_batch=bad)


@pytest.mark.parametrize("make", ALL_POLICIES.values(), ids=ALL_POLICIES.keys())
def test_a_limit_without_group_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match=r"max_groups_per_batch=2 needs group="):
        make(max_groups_per_batch=2)


@pytest.mark.parametrize("make", ALL_POLICIES.values(), ids=ALL_POLICIES.keys())
def test_a_group_that_is_not_callable_is_refused(make: Any) -> None:
    with pytest.raises(TypeError, match=r"group must be callable, got str"):
        make(group="task")


def test_from_lengths_and_from_sample_pass_the_group_on() -> None:
    lengths = list(range(1, 40))
    for policy in (
        BucketedBatcher.from_lengths(lengths, num_buckets=3, group=task),
        BucketedBatcher.from_sample(lengths, num_buckets=3, group=task, max_groups_per_batch=2),
    ):
        assert policy.group is task and policy.max_groups_per_batch in (1, 2)


def test_repr_shows_the_group_when_set() -> None:
    shown = repr(SortedBatcher(group=task, max_groups_per_batch=2))
    assert "group=<function task at " in shown and "max_groups_per_batch=2" in shown


def test_a_policy_grouped_by_a_module_level_function_pickles() -> None:
    items = [(2, "a"), (3, "b"), (1, "a")]
    for policy in (
        SortedBatcher(key=length, group=task),
        PackingBatcher(8, key=length, group=task),
    ):
        loaded = pickle.loads(pickle.dumps(policy))
        assert loaded.group is task and loaded.max_groups_per_batch == 1
        assert [b.indices for b in loaded.batches(items)] == [
            b.indices for b in policy.batches(items)
        ]


def test_a_live_settings_change_keeps_the_group() -> None:
    policy = DynamicBatcher(4, 5.0, group=task, max_groups_per_batch=2)
    changed = reconfigured(policy, 8, 2.0)
    assert changed is not policy and changed.max_batch_size == 8
    assert changed.group is task and changed.max_groups_per_batch == 2
    assert policy.max_batch_size == 4  # the original is never changed in place


# -- group_of and groups_of -----------------------------------------------------------
def _listed(item: Item) -> Any:  # (Any: mypy would refuse an unhashable group, as it should)
    return [item[1]]


def _listed_unless_str(item: object) -> Any:
    return item if isinstance(item, str) else [item]


def test_an_unhashable_group_is_a_type_error_naming_its_type() -> None:
    policy = DynamicBatcher(4, group=_listed)
    with pytest.raises(TypeError, match=r"^group\(item\) must return a hashable value, got list$"):
        policy.group_of((1, "a"))


def test_groups_of_names_the_item_whose_group_is_unhashable() -> None:
    policy = DynamicBatcher(4, group=_listed_unless_str)
    with pytest.raises(TypeError, match=r"^items\[2\]: group\(item\) must return a hashable"):
        policy.groups_of(["a", "b", 3])
    with pytest.raises(TypeError, match=r"^items\[2\]: .*hashable value, got list"):
        list(policy.batches(["a", "b", 3]))


class Missing(Exception):
    pass


def _lookup(item: str) -> str:
    if item == "?":
        raise Missing(item)
    return item


def test_the_group_functions_own_exception_propagates() -> None:
    policy = SortedBatcher(group=_lookup)
    with pytest.raises(Missing) as caught:
        policy.group_of("?")
    assert caught.value.args == ("?",) and not getattr(caught.value, "__notes__", None)
    with pytest.raises(Missing) as caught:
        list(policy.batches(["a", "?"]))
    if sys.version_info >= (3, 11):  # (add_note is 3.11's)
        assert caught.value.__notes__ == ["(while computing the group of items[1])"]


def test_a_group_functions_value_error_names_the_item() -> None:
    policy = SortedBatcher(group=lambda s: int(s))
    with pytest.raises(ValueError, match=r"^items\[1\]: invalid literal for int"):
        list(policy.batches(["1", "x"]))


def test_grouped_index_batches_needs_one_group_per_key() -> None:
    with pytest.raises(ValueError, match=r"groups has 1 entries but keys has 2"):
        DynamicBatcher(4).grouped_index_batches([1.0, 2.0], ["a"])


# -- samplers -------------------------------------------------------------------------
def _ranks(policy: Batcher, items: list[Item], world_size: int, **kw: Any) -> list[list[list[int]]]:
    lengths, groups = [n for n, _ in items], [g for _, g in items]
    return [
        list(policy.sampler(lengths, groups=groups, rank=r, world_size=world_size, **kw))
        for r in range(world_size)
    ]


@given(
    grouped_items(),
    grouped_policies(),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.integers(0, 9),
)
def test_sampler_batches_keep_the_group_limit_on_every_rank(
    items: list[Item],
    policy: Batcher,
    world_size: int,
    drop_last: bool,
    shuffle: bool,
    seed: int,
) -> None:
    ranks = _ranks(policy, items, world_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
    assert len({len(r) for r in ranks}) == 1  # no rank waits on a collective
    for r in ranks:
        for b in r:
            check_batch(policy, [items[i] for i in b])
    counts = Counter(i for r in ranks for b in r for i in b)
    if drop_last:
        assert set(counts.values()) <= {1}  # no index twice in the epoch
    else:
        assert set(counts) == set(range(len(items)))  # every index in the epoch


SAMPLED = {
    "static": lambda k: StaticBatcher(4, group=task, max_groups_per_batch=k),
    "dynamic": lambda k: DynamicBatcher(6, max_tokens=120, group=task, max_groups_per_batch=k),
    "bucketed": lambda k: BucketedBatcher(
        [8, 24], max_batch_size=5, max_tokens=100, group=task, max_groups_per_batch=k
    ),
    "sorted": lambda k: SortedBatcher(
        batch_size=7, window=30, group=task, max_groups_per_batch=k, cost="sum", max_tokens=90
    ),
    "packing": lambda k: PackingBatcher(64, group=task, max_groups_per_batch=k),
}


@pytest.mark.parametrize("make", SAMPLED.values(), ids=SAMPLED.keys())
@pytest.mark.parametrize("k", [None, 1, 2, 5])
def test_a_many_group_sampler_keeps_the_limit_for_every_rank_count_and_epoch(
    make: Any, k: int | None
) -> None:
    rng = np.random.default_rng(7)
    values = rng.integers(0, len(GROUP_VALUES), 400).tolist()
    items = [(int(n), GROUP_VALUES[g]) for n, g in zip(rng.integers(0, 40, 400), values)]
    policy = make(k)
    for world_size, drop_last, epoch in [(1, False, 0), (3, False, 1), (4, True, 2)]:
        lengths, groups = [n for n, _ in items], [g for _, g in items]
        kw = {"groups": groups, "world_size": world_size, "drop_last": drop_last, "seed": 5}
        samplers = [policy.sampler(lengths, rank=r, **kw) for r in range(world_size)]
        for s in samplers:
            s.set_epoch(epoch)
        ranks = [list(s) for s in samplers]
        assert len({len(r) for r in ranks}) == 1
        grouped = sum(len(b) for r in ranks for b in r if len({groups[i] for i in b}) > 1)
        for b in (b for r in ranks for b in r):
            check_batch(policy, [items[i] for i in b])
        counts = Counter(i for r in ranks for b in r for i in b)
        if drop_last:
            assert set(counts.values()) <= {1}
        else:
            assert set(counts) == set(range(len(items)))
        if (k or 1) > 1:
            assert grouped  # batches do combine groups when the limit lets them


@given(grouped_items(), grouped_policies(packing=False))
def test_an_unshuffled_sampler_is_the_offline_batches(items: list[Item], policy: Batcher) -> None:
    offline = [b.indices for b in policy.batches(items)]
    assert _ranks(policy, items, 1, shuffle=False) == [offline]


@given(grouped_items(max_size=40), grouped_policies(), st.integers(1, 3), st.data())
def test_a_grouped_sampler_is_deterministic_and_resumes(
    items: list[Item], policy: Batcher, world_size: int, data: st.DataObject
) -> None:
    lengths, groups = [n for n, _ in items], [g for _, g in items]
    rank = data.draw(st.integers(0, world_size - 1))
    kw: dict[str, Any] = {"groups": groups, "rank": rank, "world_size": world_size, "seed": 3}
    first = policy.sampler(lengths, **kw)
    first.set_epoch(2)
    full = list(first)
    again = policy.sampler(lengths, **kw)
    again.set_epoch(2)
    assert list(again) == full  # the same seed and epoch: the same batches
    k = data.draw(st.integers(0, len(full)))
    it = iter(first)
    seen = [next(it) for _ in range(k)]
    fresh = policy.sampler(lengths, **kw)
    fresh.load_state_dict(first.state_dict())
    assert seen + list(fresh) == full


def test_a_resume_on_other_ranks_keeps_the_group_limit() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 300).tolist()
    groups = rng.choice(["a", "b", "c", "d", "e"], 300).tolist()
    policy = SortedBatcher(batch_size=8, max_tokens=200, group=task, max_groups_per_batch=2)
    before = policy.sampler(lengths, groups=groups, rank=0, world_size=2, seed=1)
    it = iter(before)
    for _ in range(5):
        next(it)
    ranks = [policy.sampler(lengths, groups=groups, rank=r, world_size=3, seed=1) for r in range(3)]
    for sampler in ranks:
        sampler.load_state_dict(before.state_dict())
    rest = [list(s) for s in ranks]
    assert len({len(r) for r in rest}) == 1
    for b in (b for r in rest for b in r):
        assert len({groups[i] for i in b}) <= 2
    done = {i for b in before.global_batches()[:10] for i in b}
    assert {i for r in rest for b in r for i in b} == set(range(300)) - done


def test_groups_from_numpy_and_from_a_plain_policy() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    groups = np.array([0, 1, 0, 1, 2, 2, 0, 1])
    # a policy without group= still keeps one group a batch when the sampler has groups
    for b in DynamicBatcher(8).sampler(lengths, groups=groups, seed=0):
        assert len({int(groups[i]) for i in b}) == 1


def test_a_state_saved_with_other_groups_is_refused() -> None:
    lengths = [1] * 12
    policy = DynamicBatcher(3, group=task)
    saved = policy.sampler(lengths, groups=[0, 1] * 6, seed=0)
    iter(saved)
    other = policy.sampler(lengths, groups=[0] * 12, seed=0)
    with pytest.raises(ValueError, match="saved for other batches"):
        other.load_state_dict(saved.state_dict())


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        (["a"] * 3, ValueError, r"groups has 3 entries but lengths has 4"),
        (["a", "b", ["c"], "d"], TypeError, r"groups\[2\] must be hashable, got list"),
        ("abcd", TypeError, r"groups must be a sequence, got str"),
        (iter("abcd"), TypeError, r"groups must be a sequence"),
    ],
)
def test_bad_sampler_groups_are_refused(groups: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DynamicBatcher(4).sampler([1, 2, 3, 4], groups=groups)


def test_a_grouped_policys_sampler_needs_groups() -> None:
    with pytest.raises(ValueError, match=r"sampler sees lengths, not items: pass groups="):
        DynamicBatcher(4, group=task).sampler([1, 2, 3])


# -- streams --------------------------------------------------------------------------
@given(
    grouped_items(max_size=120),
    grouped_policies(),
    st.integers(1, 40),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)
def test_stream_batches_keep_the_group_limit_on_every_rank(
    items: list[Item],
    policy: Batcher,
    buffer_size: int,
    world_size: int,
    drop_last: bool,
    shuffle: bool,
) -> None:
    ranks = [
        list(
            policy.stream(
                iter(items),
                buffer_size=buffer_size,
                rank=r,
                world_size=world_size,
                shuffle=shuffle,
                drop_last=drop_last,
                sync_buckets=True,
            )
        )  # fmt: skip
        for r in range(world_size)
    ]
    assert len({len(r) for r in ranks}) == 1
    for b in (b for r in ranks for b in r):
        assert list(b) == [items[i] for i in b.indices]
        check_batch(policy, b)
    counts = Counter(i for r in ranks for b in r for i in b.indices)
    if drop_last:
        assert set(counts.values()) <= {1}
    else:
        assert set(counts) == set(range(len(items)))


def test_a_stream_names_the_position_of_an_unhashable_group() -> None:
    policy = DynamicBatcher(4, group=_listed)
    with pytest.raises(TypeError, match=r"from position 0: items\[0\]: .*hashable value, got list"):
        list(policy.stream([(1, "a"), (2, "b")], buffer_size=4))
