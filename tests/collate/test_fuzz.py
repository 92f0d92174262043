"""Fuzzing every collator with malformed input: a correct result or a clear
TypeError/ValueError that names the offending item or key, never anything else."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit

scalar = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=False, width=32),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.binary(max_size=2),
)
leafy = st.recursive(
    scalar | st.builds(lambda n, d: np.zeros((n, d)), st.integers(0, 3), st.integers(1, 2)),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=10,
)
batch = st.lists(leafy, min_size=0, max_size=5)

ALLOWED = (TypeError, ValueError)


def _check(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except ALLOWED as exc:
        msg = str(exc)
        assert msg, "an error without a message"
    # Anything else propagates and fails the test.


@settings(max_examples=150, deadline=None)
@given(batch)
def test_layouts_never_crash_on_garbage(items) -> None:
    _check(batchkit.pad, items)
    _check(batchkit.pad, items, side="left", pad_to_multiple_of=4, max_length=3)
    _check(batchkit.pack_varlen, items, pad_to_multiple_of=8)
    _check(batchkit.pack, items, 4)
    _check(batchkit.pack, items, 4, split=True, strategy="first_fit")
    _check(batchkit.stack, items)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.sampled_from(["input_ids", "labels", "label", "x"]), leafy, max_size=3),
        max_size=4,
    )
)
def test_dict_collators_never_crash_on_garbage(features) -> None:
    _check(batchkit.PadCollator(return_tensors="np"), features)
    _check(batchkit.VarlenCollator(return_tensors="np"), features)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=6), st.integers(0, 5))
def test_one_bad_item_is_named(good, position) -> None:
    items = list(good)
    position = min(position, len(items))
    items.insert(position, "oops")
    try:
        batchkit.pad(items)
    except TypeError as exc:
        assert f"item {position}" in str(exc)
    else:
        raise AssertionError("a string item was accepted")
