"""Grouped (MoE) quantize / dequantize reference (`jax_fp4.reference.grouped`, docs/numerics.md section 4).

The contract: every group's slices of data / scale (and its amax) equal, bit for bit, the single-tensor reference
`jax_fp4.reference.quantize` of that group's matrix; grouped_dequantize equals the per-group dequantize. Group sizes
are passed to a jitted function as arrays, so they are traced. Group dims come from a small set so the per-group
reference compiles once per shape (XLA:CPU compiles dominate the runtime of this file).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jax_fp4.formats import MXFP8, NVFP4
from jax_fp4.reference import dequantize, quantize
from jax_fp4.reference.grouped import (
    GroupedQuantized,
    Representation,
    group_has_nan,
    grouped_dequantize,
    grouped_quantize,
)

R = Representation
N = 4
# Group dims [M_g, K_g] (block-aligned for both formats): non-empty groups are [32, 64] or [64, 32], so the
# per-group reference compiles twice per format and axis, and a transposed geometry cannot pass.
PAIRS = ((0, 0), (0, 64), (32, 0), (32, 64), (64, 32))
# x buffer of each representation: capacity for N groups (SAME_BOTH_DIMS: 3 groups [32, 64]).
SHAPES = {R.SAME_BOTH_DIMS: (96, 64), R.VARYING_FIRST_DIM: (N * 32, 64), R.VARYING_LAST_DIM: (64, N * 32),
          R.VARYING_BOTH_DIMS: (N * 2048,)}
FORMATS = [NVFP4(), MXFP8()]
HYP = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_ref_quantize = jax.jit(quantize, static_argnames=("fmt", "axis"))
_ref_dequantize = jax.jit(dequantize, static_argnames=("fmt", "axis", "dtype"))
_grouped_dequantize = jax.jit(grouped_dequantize, static_argnames=("dtype",))


@functools.cache
def _grouped_fn(fmt, axis, rep, vmapped=False):
    """jit(grouped_quantize) with traced first_dims / last_dims (cached: one compile per configuration)."""

    def f(x, fd, ld, key):
        return grouped_quantize(
            x, fmt, axis=axis, key=key, num_groups=3 if rep is R.SAME_BOTH_DIMS else None,
            first_dims=fd if rep in (R.VARYING_FIRST_DIM, R.VARYING_BOTH_DIMS) else None,
            last_dims=ld if rep in (R.VARYING_LAST_DIM, R.VARYING_BOTH_DIMS) else None,
        )

    return jax.jit(jax.vmap(f, in_axes=(0, None, None, None)) if vmapped else f)


def _group_dims(rep, pairs):
    """numpy rows, cols of every group (independent of the implementation under test), first_dims, last_dims.

    pairs: N (M, K) pairs; VARYING_FIRST_DIM uses M > 0 -> 32 (K = 64), VARYING_LAST_DIM K > 0 -> 32 (M = 64),
    VARYING_BOTH_DIMS the pairs as they are."""
    shape = SHAPES[rep]
    fd, ld = (np.array([p[i] for p in pairs], np.int32) for i in (0, 1))
    if rep is R.VARYING_FIRST_DIM:
        fd = np.where(fd > 0, 32, 0).astype(np.int32)
    if rep is R.VARYING_LAST_DIM:
        ld = np.where(ld > 0, 32, 0).astype(np.int32)
    if rep is R.SAME_BOTH_DIMS:
        return np.full(3, shape[0] // 3), np.full(3, shape[1]), fd, ld
    if rep is R.VARYING_FIRST_DIM:
        return fd, np.full(N, shape[1]), fd, ld
    if rep is R.VARYING_LAST_DIM:
        return np.full(N, shape[0]), ld, fd, ld
    return fd, ld, fd, ld


def _data(seed, shape, dtype=np.float32):
    """Normal values over a wide range of magnitudes, with zero runs and a few NaN / inf / subnormal values."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n).astype(np.float64))
    for _ in range(3):  # zero runs (whole zero blocks, maybe whole zero groups)
        i = rng.integers(0, n)
        x[i : i + rng.integers(1, 200)] = 0
    special = rng.random(n) < 0.002
    x[special] = rng.choice([np.nan, np.inf, -np.inf, 1e-40, -2688.0], special.sum())
    return jnp.asarray(x.reshape(shape).astype(np.float32)).astype(dtype)


def _bytes(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _check(gq: GroupedQuantized, x, rows, cols, fmt, axis, key=None, skip=()):
    """The contract, group by group, against the single-tensor reference (groups in `skip` are not compared)."""
    bs = fmt.block_size
    off = np.concatenate([[0], np.cumsum(rows.astype(np.int64) * cols)])
    np.testing.assert_array_equal(gq.offsets, off)
    np.testing.assert_array_equal(gq.first_dims, rows)
    np.testing.assert_array_equal(gq.last_dims, cols)
    assert gq.data.shape == (x.size,) and gq.data.dtype == fmt.data_dtype
    assert gq.scale.shape == (x.size // bs,) and gq.scale.dtype == fmt.scale_dtype
    data, scale, flat = _bytes(gq.data), _bytes(gq.scale), np.asarray(x).reshape(-1)
    refs = []
    for g in range(len(rows)):
        d, s = data[off[g] : off[g + 1]], scale[off[g] // bs : off[g + 1] // bs]
        if g in skip:
            refs.append(None)
            continue
        xg = flat[off[g] : off[g + 1]].reshape(rows[g], cols[g])
        if xg.size == 0:  # an empty group: empty slices, amax 0
            assert d.size == 0 and s.size == 0
            if isinstance(fmt, NVFP4):
                assert _bytes(gq.amax)[g] == 0
            refs.append(None)
            continue
        kg = None if key is None else jax.random.fold_in(key, g)
        ref = _ref_quantize(jnp.asarray(xg), fmt, axis=axis, key=kg)
        np.testing.assert_array_equal(d, _bytes(ref.data).reshape(-1), err_msg=f"group {g} data")
        np.testing.assert_array_equal(s, _bytes(ref.scale).reshape(-1), err_msg=f"group {g} scale")
        if isinstance(fmt, NVFP4):
            assert _bytes(gq.amax)[g] == _bytes(ref.amax), f"group {g} amax"
        else:
            assert gq.amax is None
        refs.append(ref)
    if not skip:  # buffer past the last group: code 0
        assert not data[off[-1] :].any() and not scale[off[-1] // bs :].any()
    return off, refs


def _quantize(rep, fmt, axis, pairs, seed, dtype=np.float32, key=None):
    rows, cols, fd, ld = _group_dims(rep, pairs)
    x = _data(seed, SHAPES[rep], dtype)
    gq = _grouped_fn(fmt, axis, rep)(x, jnp.asarray(fd), jnp.asarray(ld), key)
    return gq, x, rows, cols


pairs_st = st.lists(st.sampled_from(PAIRS), min_size=N, max_size=N)
seed_st = st.integers(0, 2**31 - 1)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
@pytest.mark.parametrize("rep", list(R), ids=lambda r: r.value)
@HYP
@given(pairs=pairs_st, seed=seed_st)
@example(pairs=[(32, 64)] * N, seed=0)  # groups filling the whole buffer (VARYING_BOTH_DIMS: half of it)
def test_contract(rep, fmt, axis, pairs, seed):
    gq, x, rows, cols = _quantize(rep, fmt, axis, pairs, seed)
    assert gq.representation is rep and gq.axis == axis and gq.x_shape == x.shape
    _check(gq, x, rows, cols, fmt, axis)


RHT_SR = NVFP4(rht=True, stochastic_rounding=True)  # the wgrad operands' format
SR = NVFP4(stochastic_rounding=True)


@pytest.mark.parametrize(
    "fmt, axis, rep, dtype",
    [(RHT_SR, 0, R.VARYING_FIRST_DIM, jnp.bfloat16), (SR, -1, R.VARYING_LAST_DIM, jnp.float32)],
    ids=repr,
)
@HYP
@given(pairs=pairs_st, seed=seed_st)
def test_contract_rht_sr(fmt, axis, rep, dtype, pairs, seed):
    """RHT and stochastic rounding: group g equals quantize(x_g, key=fold_in(key, g))."""
    key = jax.random.key(seed)
    gq, x, rows, cols = _quantize(rep, fmt, axis, pairs, seed, dtype, key)
    _check(gq, x, rows, cols, fmt, axis, key)


def test_stochastic_rounding_streams_differ_per_group():
    """Identical groups get different random streams (fold_in by group index), the same ones for the same key."""
    rep, n = R.VARYING_LAST_DIM, 64 * 32
    half = np.linspace(-5.0, 5.0, n, dtype=np.float32)
    x = jnp.asarray(np.concatenate([half, half, np.zeros(n * 2, np.float32)]).reshape(SHAPES[rep]))
    _, _, fd, ld = _group_dims(rep, [(0, 32), (0, 32), (0, 0), (0, 0)])
    def run(fmt, key):
        return _bytes(_grouped_fn(fmt, -1, rep)(x, fd, ld, key).data)

    a, b, c = run(SR, jax.random.key(1)), run(SR, jax.random.key(1)), run(SR, jax.random.key(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a[:n], a[n : 2 * n])
    d = run(NVFP4(), None)  # round to nearest: identical groups, identical codes
    assert np.array_equal(d[:n], d[n : 2 * n])


def test_e5m2():
    rows, cols, fd, ld = _group_dims(R.VARYING_LAST_DIM, [(0, 32), (0, 0), (0, 32), (0, 32)])
    x = _data(7, SHAPES[R.VARYING_LAST_DIM]) * 64
    fmt = MXFP8(element="e5m2")
    gq = _grouped_fn(fmt, 0, R.VARYING_LAST_DIM)(x, jnp.asarray(fd), jnp.asarray(ld), None)
    _check(gq, x, rows, cols, fmt, 0)


@pytest.mark.parametrize(
    "fmt, axis, in_dtype, out_dtype",
    [(NVFP4(), -1, jnp.float32, jnp.float32), (RHT_SR, 0, jnp.bfloat16, jnp.bfloat16),
     (MXFP8(), -1, jnp.float32, jnp.bfloat16), (MXFP8(), 0, jnp.float32, jnp.float16)],
    ids=repr,
)
def test_dequantize(fmt, axis, in_dtype, out_dtype):
    """grouped_dequantize == per-group dequantize; positions outside every group are 0."""
    key = jax.random.key(5) if fmt.name == "NVFP4" and fmt.stochastic_rounding else None
    pairs = [(32, 0), (0, 0), (32, 0), (32, 0)]
    gq, x, rows, cols = _quantize(R.VARYING_FIRST_DIM, fmt, axis, pairs, 3, in_dtype, key)
    off, refs = _check(gq, x, rows, cols, fmt, axis, key)
    out = _grouped_dequantize(gq, out_dtype)
    assert out.shape == x.shape and out.dtype == out_dtype
    flat = _bytes(out).reshape(-1)
    for g, ref in enumerate(refs):
        if ref is not None:
            want = _ref_dequantize(*ref, fmt=fmt, axis=axis, dtype=out_dtype)
            np.testing.assert_array_equal(flat[off[g] : off[g + 1]], _bytes(want).reshape(-1), err_msg=f"group {g}")
    assert not flat[off[-1] :].any()


@pytest.mark.parametrize(
    "fmt, axis, pairs, bad",
    [
        # group 1 is [8, 24]: K not a multiple of 16 (its size 192 is); group 2 [3, 8]: size 24, shifts the rest.
        (NVFP4(), -1, [(32, 64), (8, 24), (3, 8), (64, 32)], (1, 2)),
        # group 1 is [40, 32]: M not a multiple of 32; group 2 [24, 1]: size 24, not a multiple of 32.
        (MXFP8(), 0, [(64, 32), (40, 32), (24, 1), (32, 64)], (1, 2)),
    ],
    ids=repr,
)
def test_traced_misaligned_group_is_confined(fmt, axis, pairs, bad):
    """Traced misaligned sizes cannot raise; they poison only their own group (NaN scale codes, NaN MXFP8 data,
    NaN NVFP4 amax); the other groups keep the contract (scales at offsets // block)."""
    gq, x, rows, cols = _quantize(R.VARYING_BOTH_DIMS, fmt, axis, pairs, 11)
    off, _ = _check(gq, x, rows, cols, fmt, axis, skip=bad)
    bs, nvfp4 = fmt.block_size, isinstance(fmt, NVFP4)
    for g in bad:
        assert (_bytes(gq.scale)[off[g] // bs : off[g + 1] // bs] == (0x7F if nvfp4 else 0xFF)).all(), g
        assert np.isnan(np.asarray(gq.amax)[g]) if nvfp4 else (_bytes(gq.data)[off[g] : off[g + 1]] == 0x7F).all()
    assert np.isfinite(np.asarray(_grouped_dequantize(gq, jnp.float32))).any()


@pytest.mark.parametrize(
    "kwargs, shape, axis, match",
    [
        ({"first_dims": np.array([32, 24])}, (56, 64), 0, "group 1 .* first dim M = 24"),
        ({"last_dims": [16, 40, 16]}, (32, 72), -1, "group 1 .* last dim K = 40"),
        ({"first_dims": np.array([2, 3]), "last_dims": np.array([32, 8])}, (88,), -1, "group 1 .* K = 8"),
        ({"num_groups": 2}, (64, 24), -1, "last dim K is 24"),
        ({"num_groups": 2}, (48, 64), 0, "first dim M is 24"),
        ({"first_dims": np.array([64, 64])}, (96, 32), -1, "more than x"),
        ({"first_dims": np.array([32, -32])}, (64, 32), -1, "negative"),
        ({"num_groups": 3}, (64, 32), -1, "not divisible"),
        ({"first_dims": np.array([32]), "last_dims": np.array([32])}, (32, 32), -1, "1-D x"),
        ({}, (64, 32), -1, "num_groups"),
    ],
)
def test_concrete_misaligned_sizes_raise(kwargs, shape, axis, match):
    with pytest.raises(ValueError, match=match):
        grouped_quantize(jnp.ones(shape, jnp.float32), NVFP4(), axis=axis, **kwargs)


def test_static_misalignment_raises_under_jit():
    f = jax.jit(lambda x, fd: grouped_quantize(x, MXFP8(), first_dims=fd))
    with pytest.raises(ValueError, match="last dim K is 48"):
        f(jnp.ones((64, 48)), jnp.array([32, 32]))


@pytest.mark.parametrize(
    "fmt, kw, match",
    [
        (NVFP4(scaling_2d=True), {}, "not supported for grouped"),
        (NVFP4(local_1x64=True), {}, "not supported for grouped"),
        (NVFP4(stochastic_rounding=True), {}, "PRNG key"),
        ("nvfp4", {}, "fmt must be"),
        (NVFP4(), {"axis": 2}, "axis must be"),
    ],
    ids=str,
)
def test_unsupported_options_raise(fmt, kw, match):
    with pytest.raises(ValueError, match=match):
        grouped_quantize(jnp.ones((64, 64), jnp.float32), fmt, num_groups=2, **kw)


def test_bad_dtype_raises():
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        grouped_quantize(jnp.ones((64, 64), jnp.int32), MXFP8(), num_groups=2)


def test_jit_vmap():
    """vmap over a leading batch of x (sizes shared): each batch element equals the unbatched result; the
    batched GroupedQuantized dequantizes under vmap too."""
    fmt, axis, rep = NVFP4(), -1, R.VARYING_FIRST_DIM
    _, _, fd, ld = _group_dims(rep, [(32, 0), (0, 0), (32, 0), (32, 0)])
    xb = jnp.stack([_data(s, SHAPES[rep]) for s in (3, 4)])
    gb = _grouped_fn(fmt, axis, rep, vmapped=True)(xb, fd, ld, None)
    assert gb.data.shape == (2, xb[0].size) and gb.amax.shape == (2, N)
    deq = jax.jit(jax.vmap(grouped_dequantize))(gb)
    for i in range(2):
        one = _grouped_fn(fmt, axis, rep)(xb[i], fd, ld, None)
        for f in ("data", "scale", "amax", "offsets", "first_dims", "last_dims"):
            np.testing.assert_array_equal(_bytes(getattr(gb, f)[i]), _bytes(getattr(one, f)), err_msg=f)
        np.testing.assert_array_equal(_bytes(deq[i]), _bytes(_grouped_dequantize(one, jnp.float32)))


@settings(max_examples=25, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(-2, 70), st.integers(0, 40)), min_size=1, max_size=6),
    extra=st.integers(-1500, 3000),
    rate=st.sampled_from([0.0, 0.0005, 0.02]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_has_nan(dims, extra, rate, seed):
    """group_has_nan (chunked NaN counts at the group offsets) against a per-group scan of the buffer, groups at any
    offset (not chunk-aligned), empty and negative sizes, groups truncated by the buffer's end."""
    rng = np.random.default_rng(seed)
    rows, cols = (np.array(d, np.int32) for d in zip(*dims, strict=True))
    off = np.concatenate([[0], np.cumsum(np.maximum(rows, 0) * cols)])
    size = max(0, int(off[-1]) + extra)
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.random(size) < rate] = np.nan
    off = np.minimum(off, size)
    want = np.array([np.isnan(x[off[g] : off[g + 1]]).any() for g in range(len(rows))])
    np.testing.assert_array_equal(np.asarray(group_has_nan(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(cols))), want)
