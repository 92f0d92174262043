"""Every layout and collator takes arrays of any Array API library (torch, JAX,
array-api-strict, CuPy) and gives back arrays of that library, on the items' device,
equal element for element to what numpy input gives; the inverses give each item
back exactly. A library that is not installed is skipped, saying which extra has it."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit._backend import array_kind, device_of


@dataclass(frozen=True)
class Library:
    """How a test makes one library's arrays from numpy, and reads them back."""

    name: str
    make: Callable[[np.ndarray], Any]
    back: Callable[[Any], np.ndarray]


def _torch() -> Library:
    return Library("torch", lambda a: torch.from_numpy(a.copy()), lambda x: x.numpy())


def _jax() -> Library:
    import jax.numpy as jnp

    return Library("jax", jnp.asarray, np.asarray)


def _strict() -> Library:
    import array_api_strict as xps

    return Library("array_api_strict", xps.asarray, lambda x: np.from_dlpack(x))


def _cupy() -> Library:
    import cupy

    return Library("cupy", cupy.asarray, cupy.asnumpy)


def _has_gpu_for_cupy() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no cupy, no driver, no device
        return False


def _library(module: str, build: Callable[[], Library], why: str) -> Any:
    if importlib.util.find_spec(module) is None:
        return pytest.param(None, id=module, marks=pytest.mark.skip(reason=why))
    return pytest.param(build, id=module)


LIBRARIES = [
    pytest.param(_torch, id="torch"),
    _library("jax", _jax, 'needs jax: pip install -e ".[jax]"'),
    _library("array_api_strict", _strict, 'needs array-api-strict: pip install -e ".[test]"'),
    pytest.param(
        _cupy,
        id="cupy",
        marks=pytest.mark.skipif(not _has_gpu_for_cupy(), reason="needs cupy and a CUDA GPU"),
    ),
]


@pytest.fixture(scope="module", params=LIBRARIES)
def lib(request: pytest.FixtureRequest) -> Library:
    build: Callable[[], Library] = request.param
    return build()


@st.composite
def host_items(draw: st.DrawFn) -> list[np.ndarray]:
    """1-5 items of lengths 0-7, one dtype JAX holds without x64, features () or (2,)."""
    dtype = draw(st.sampled_from(["int32", "float32", "bool"]))
    feat = draw(st.sampled_from([(), (2,)]))
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    out = []
    for n in lengths:
        raw = rng.integers(-50, 50, size=(n, *feat))
        out.append((raw > 0) if dtype == "bool" else raw.astype(dtype))
    return out


def _pad_value(items: list[np.ndarray]) -> Any:
    return True if items[0].dtype == bool else 7


def _check_same(lib: Library, got: Any, want: Any, device: Any, what: str) -> None:
    """``got`` is an array of ``lib`` on ``device`` equal to the numpy ``want``."""
    assert array_kind(got) == array_kind(lib.make(np.zeros(1))), (what, type(got))
    assert device_of(got) == device, (what, device_of(got), device)
    host = lib.back(got)
    want = np.asarray(want)
    assert host.shape == want.shape, (what, host.shape, want.shape)
    np.testing.assert_array_equal(host, want.astype(host.dtype), err_msg=what)


def _check_items_back(lib: Library, got: list[Any], items: list[Any]) -> None:
    assert len(got) == len(items)
    for i, (g, item) in enumerate(zip(got, items, strict=True)):
        assert g.dtype == item.dtype, (i, g.dtype, item.dtype)
        _check_same(lib, g, lib.back(item), device_of(item), f"item {i}")


def _as_lib(lib: Library, arrays: list[np.ndarray]) -> tuple[list[Any], list[np.ndarray]]:
    """The items in ``lib``, and the numpy reference of exactly those values and dtypes
    (JAX without x64 holds int64 as int32, say)."""
    items = [lib.make(a) for a in arrays]
    return items, [lib.back(x).copy() for x in items]


@settings(max_examples=25, deadline=None)
@given(
    arrays=host_items(),
    side=st.sampled_from(["right", "left"]),
    multiple=st.sampled_from([None, 4]),
)
def test_pad_equals_numpy_and_unpads_exactly(
    lib: Library, arrays: list[np.ndarray], side: str, multiple: int | None
) -> None:
    items, ref_items = _as_lib(lib, arrays)
    device = device_of(items[0])
    pad_value = _pad_value(arrays)
    want = batchkit.pad(ref_items, pad_value=pad_value, side=side, pad_to_multiple_of=multiple)  # type: ignore[arg-type]
    got = batchkit.pad(items, pad_value=pad_value, side=side, pad_to_multiple_of=multiple)  # type: ignore[arg-type]
    for name in ("data", "mask", "lengths"):
        _check_same(lib, getattr(got, name), getattr(want, name), device, name)
    assert lib.back(got.mask).dtype == bool
    _check_items_back(lib, got.unpad(got.data), items)


@settings(max_examples=25, deadline=None)
@given(arrays=host_items(), multiple=st.sampled_from([None, 8]), spare=st.integers(0, 2))
def test_pack_varlen_equals_numpy_and_unpacks_exactly(
    lib: Library, arrays: list[np.ndarray], multiple: int | None, spare: int
) -> None:
    items, ref_items = _as_lib(lib, arrays)
    device = device_of(items[0])
    segments = len(items) + 1 + spare
    kwargs: dict[str, Any] = {"pad_to_multiple_of": multiple, "num_segments": segments}
    want = batchkit.pack_varlen(ref_items, pad_value=_pad_value(arrays), **kwargs)
    got = batchkit.pack_varlen(items, pad_value=_pad_value(arrays), **kwargs)
    for name in ("values", "cu_seqlens", "position_ids", "seq_lens", "segment_ids"):
        _check_same(lib, getattr(got, name), getattr(want, name), device, name)
    assert got.max_seqlen == want.max_seqlen and isinstance(got.max_seqlen, int)
    assert lib.back(got.cu_seqlens).shape == (segments + 1,)
    _check_items_back(lib, got.unpack(got.values), items)


@settings(max_examples=25, deadline=None)
@given(
    arrays=host_items(),
    strategy=st.sampled_from(["best_fit", "first_fit", "in_order"]),
    split=st.booleans(),
)
def test_pack_equals_numpy_and_unpacks_exactly(
    lib: Library, arrays: list[np.ndarray], strategy: str, split: bool
) -> None:
    items, ref_items = _as_lib(lib, arrays)
    device = device_of(items[0])
    row = 4 if split else 8
    kwargs: dict[str, Any] = {"strategy": strategy, "split": split, "pad_value": _pad_value(arrays)}
    want = batchkit.pack(ref_items, row, **kwargs)
    got = batchkit.pack(items, row, **kwargs)
    for name in ("data", "position_ids", "segment_ids", "cu_seqlens"):
        _check_same(lib, getattr(got, name), getattr(want, name), device, name)
    assert got.pieces == want.pieces and got.max_seqlen == want.max_seqlen
    _check_items_back(lib, got.unpack(got.data), items)


@settings(max_examples=15, deadline=None)
@given(arrays=host_items())
def test_stack_and_unstack_keep_the_library(lib: Library, arrays: list[np.ndarray]) -> None:
    first = arrays[0]
    items = [{"x": lib.make(first + 0), "n": i} for i in range(3)]
    batch = batchkit.stack(items)
    _check_same(lib, batch["x"], np.stack([first] * 3), device_of(items[0]["x"]), "x")
    back = batchkit.unstack(batch)
    assert [b["n"] for b in back] == [0, 1, 2]
    _check_items_back(lib, [b["x"] for b in back], [it["x"] for it in items])


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    side=st.sampled_from(["right", "left"]),
)
def test_pad_collator_equals_numpy(lib: Library, lengths: list[int], side: str) -> None:
    ids = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    features = [
        {"input_ids": lib.make(a), "labels": lib.make(a * 2), "idx": i} for i, a in enumerate(ids)
    ]
    reference = [{k: (lib.back(v) if k != "idx" else v) for k, v in f.items()} for f in features]
    collate = batchkit.PadCollator(padding_side=side, pad_to_multiple_of=4)  # type: ignore[arg-type]
    want, got = collate(reference), collate(features)
    assert set(got) == set(want) == {"input_ids", "labels", "idx", "attention_mask"}
    device = device_of(features[0]["input_ids"])
    for key in want:
        _check_same(lib, got[key], want[key], device, key)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(any))
def test_varlen_collator_equals_numpy(lib: Library, lengths: list[int]) -> None:
    ids = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    features = [
        {"input_ids": lib.make(a), "weights": lib.make(a * 0.5), "idx": 10 + i}
        for i, a in enumerate(ids)
    ]
    reference = [{k: (lib.back(v) if k != "idx" else v) for k, v in f.items()} for f in features]
    collate = batchkit.VarlenCollator(return_sample_index=True)
    want, got = collate(reference), collate(features)
    assert set(got) == set(want)
    device = device_of(features[0]["input_ids"])
    for key, value in want.items():
        if isinstance(value, int):
            assert got[key] == value, key
        else:
            _check_same(lib, got[key], value, device, key)


@pytest.mark.parametrize("name", ["jax", "array_api_strict"])
def test_return_tensors_takes_a_name_or_a_namespace(name: str) -> None:
    module = {"jax": "jax.numpy", "array_api_strict": "array_api_strict"}[name]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"needs {name}")
    xp = importlib.import_module(module)
    kind = array_kind(xp.asarray([1]))
    for given_as in (name, xp):
        padded = batchkit.pad([[1, 2], [3]], return_tensors=given_as)
        assert array_kind(padded.data) == kind and array_kind(padded.mask) == kind
        assert np.asarray(padded.data).tolist() == [[1, 2], [3, 0]]
    from_torch = batchkit.pack_varlen([torch.arange(3), torch.arange(2)], return_tensors=name)
    assert array_kind(from_torch.values) == kind
    assert batchkit.PadCollator(return_tensors=name)([{"input_ids": [1]}])["input_ids"].shape == (
        1,
        1,
    )


def test_return_tensors_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match=r"return_tensors must be .*'tf'"):
        batchkit.pad([[1]], return_tensors="tf")
    with pytest.raises(TypeError, match="return_tensors must be"):
        batchkit.pad([[1]], return_tensors=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an Array API namespace"):
        batchkit.pad([[1]], return_tensors=importlib.import_module("json"))


# ------------------------------------------------------------- no host round trip


@contextmanager
def _strict_arrays_unreadable_on_host() -> Iterator[None]:
    """Every way array-api-strict hands its data to the host raises inside the block."""
    strict = pytest.importorskip("array_api_strict")
    array_type = type(strict.asarray([0]))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a collator read an array back to the host")

    names = ("__array__", "__dlpack__", "__int__", "__float__", "__bool__", "__index__", "tolist")
    saved = {n: array_type.__dict__[n] for n in names if n in array_type.__dict__}
    for n in saved:
        setattr(array_type, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(array_type, n, f)


def test_layouts_never_read_the_arrays_back() -> None:
    """Lengths, offsets and max_seqlen come from shapes: with every host read of the
    items refused, each layout and collator still builds its batch and inverse."""
    strict = pytest.importorskip("array_api_strict")
    items = [strict.asarray([1, 2, 3]), strict.asarray([4]), strict.asarray([5, 6])]
    with _strict_arrays_unreadable_on_host():
        with pytest.raises(AssertionError, match="read an array back"):
            np.asarray(items[0])  # the guard is on
        padded = batchkit.pad(items, side="left", pad_to_multiple_of=4)
        padded.unpad(padded.data)
        varlen = batchkit.pack_varlen(items, pad_to_multiple_of=8, num_segments=5)
        varlen.unpack(varlen.values)
        assert varlen.segment_ids.shape == (8,) and varlen.max_seqlen == 3
        packed = batchkit.pack(items, 2, split=True)
        packed.unpack(packed.data)
        batchkit.unstack(batchkit.stack([{"x": items[0]}, {"x": items[0]}]))
        features = [{"input_ids": x, "idx": i} for i, x in enumerate(items)]
        batchkit.PadCollator()(features)
        flat = batchkit.VarlenCollator(return_sample_index=True)(features)
        assert flat["max_length_q"] == 3


def test_torch_layouts_stay_on_a_device_without_host_copies() -> None:
    """On torch's "meta" device every host copy fails (there is no data): every layout
    and collator builds its batch there, each output on that device."""
    items = [torch.arange(3, device="meta"), torch.arange(5, device="meta")]
    features = [{"input_ids": x, "idx": i, "weights": x * 1.0} for i, x in enumerate(items)]
    outputs: dict[str, Any] = {
        "pad": batchkit.pad(items, pad_to_multiple_of=8).data,
        "pack_varlen": batchkit.pack_varlen(items, num_segments=4).cu_seqlens,
        "pack": batchkit.pack(items, 8).segment_ids,
        "stack": batchkit.stack([{"x": items[0]}] * 2)["x"],
        **{
            f"PadCollator {k}": v
            for k, v in batchkit.PadCollator(pad_values={"weights": 0.0})(features).items()
        },
    }
    flat = batchkit.VarlenCollator(return_sample_index=True)(features)
    outputs.update({f"VarlenCollator {k}": v for k, v in flat.items() if not isinstance(v, int)})
    off_device = {name: str(x.device) for name, x in outputs.items() if x.device.type != "meta"}
    assert not off_device


# --------------------------------------------------------------- static shapes


def test_jit_over_padded_batches_compiles_once_per_width() -> None:
    jax = pytest.importorskip("jax", reason='needs jax: pip install -e ".[jax]"')
    jnp = jax.numpy
    traced: list[tuple[int, ...]] = []

    @jax.jit
    def masked_sum(data: Any, mask: Any) -> Any:
        traced.append(tuple(data.shape))  # runs only while jit traces a new shape
        return jnp.sum(jnp.where(mask, data, 0), axis=1)

    batches = [[3, 5, 1], [8, 2, 2], [1, 1, 1], [9, 4, 2], [16, 3, 3], [7, 7, 7]]
    for lengths in batches:
        padded = batchkit.pad([jnp.arange(n) for n in lengths], pad_to_multiple_of=8)
        sums = masked_sum(padded.data, padded.mask)
        assert np.asarray(sums).tolist() == [n * (n - 1) // 2 for n in lengths]
    assert traced == [(3, 8), (3, 16)]  # two widths, two compiles for six batches


def test_jit_over_varlen_packs_compiles_once_with_fixed_segments() -> None:
    jax = pytest.importorskip("jax", reason='needs jax: pip install -e ".[jax]"')
    jnp = jax.numpy
    traced: list[tuple[tuple[int, ...], ...]] = []

    @jax.jit
    def per_segment_sums(values: Any, segment_ids: Any, cu_seqlens: Any) -> Any:
        traced.append((values.shape, segment_ids.shape, cu_seqlens.shape))
        same = segment_ids[:, None] == segment_ids[None, :]  # block-diagonal attention mask
        return jnp.sum(jnp.where(same, values[None, :], 0), axis=1)

    batches = [[5, 3], [10, 1, 2, 4], [2], [6, 6, 6, 6], [1, 2, 3]]
    for lengths in batches:
        items = [jnp.arange(n) + 1 for n in lengths]
        pack = batchkit.pack_varlen(items, pad_to_multiple_of=32, num_segments=6)
        out = per_segment_sums(pack.values, pack.segment_ids, pack.cu_seqlens)
        sums = [int(x[0]) for x in pack.unpack(out)]
        assert sums == [n * (n + 1) // 2 for n in lengths]
    assert len(traced) == 1  # five batches of 1-4 items, one compile

    unfixed: list[int] = []

    @jax.jit
    def count(cu_seqlens: Any) -> Any:
        unfixed.append(cu_seqlens.shape[0])
        return cu_seqlens[-1]

    for lengths in batches:
        count(
            batchkit.pack_varlen([jnp.arange(n) for n in lengths], pad_to_multiple_of=32).cu_seqlens
        )
    assert len(unfixed) == 4  # without num_segments, one compile per number of items


def test_num_segments_refuses_a_batch_with_more() -> None:
    with pytest.raises(
        ValueError, match=r"pack_varlen: the batch has 3 segments but num_segments=2"
    ):
        batchkit.pack_varlen([[1], [2], [3]], num_segments=2)
    with pytest.raises(ValueError, match=r"pack: .*num_segments=1"):
        batchkit.pack([[1], [2]], 4, num_segments=1)
    with pytest.raises(ValueError, match="num_segments must be a positive int"):
        batchkit.pack_varlen([[1]], num_segments=0)
