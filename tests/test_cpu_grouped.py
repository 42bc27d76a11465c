"""The CPU FFI handlers `jf4_grouped_quantize` / `jf4_grouped_dequantize` (`_jax_fp4_cpu`) against the reference.

Each test binds the grouped primitive on the CPU, where it lowers to the host handler (the HLO must hold the custom
call, so a test cannot silently pass on the reference), and calls the reference lowering's own functions
(`reference_quantize`, `reference_dequantize`: `jax_fp4.reference.grouped`) as the oracle; every output must have the
same bits. The group sizes are operands (traced), so misaligned groups, the aligned groups after them at odd offsets
(NVFP4 bytes shared by two groups), empty groups and buffer tails past the last group all reach the handler.

Skipped where the CPU extension is not built.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _quantize_util import EDGE, assert_dbias_close, assert_same_bits, dtype_id, random_input
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.ffi_codes import Kind, QuantizeOption
from jax_fp4._src.primitives.grouped import (
    MAX_KERNEL_GROUPS,
    grouped_dequantize_p,
    grouped_quantize_p,
    quantize_result_shapes,
    reference_dequantize,
    reference_quantize,
)
from jax_fp4.reference.grouped import Representation as R

pytestmark = pytest.mark.skipif(not ffi.HAS_CPU_KERNELS, reason=f"CPU extension not built: {ffi.cpu_import_error()}")

Q_TARGET, DQ_TARGET = "jf4_grouped_quantize", "jf4_grouped_dequantize"
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_NV, _NV_SR, _NV_RHT = NVFP4(), NVFP4(stochastic_rounding=True), NVFP4(rht=True)
_NV_RHT_SR = NVFP4(rht=True, stochastic_rounding=True)
_MX, _MX5 = MXFP8(), MXFP8(element="e5m2")


def _has_call(fn, args, name):
    text = jax.jit(fn).lower(*args).as_text()
    assert re.search(rf"custom_call\s*@{name}\b", text), f"no {name} custom call in the CPU HLO"


# ---- quantize -------------------------------------------------------------------------------------------------------
# Most tests share one geometry (a buffer of SIZE elements, N groups: shorter size lists are padded with empty groups)
# so that the handler and the reference compile once per format pairing and dtype.
SIZE, N = 16384, 8


@functools.cache
def _quantize_fns(row_fmt, col_fmt, amax_given):
    p = dict(row_fmt=row_fmt, col_fmt=col_fmt, representation=R.VARYING_BOTH_DIMS, dbias=False,
             amax_given=amax_given)
    kernel = jax.jit(lambda *a: tuple(grouped_quantize_p.bind(*a, **p)[:6]))
    ref = jax.jit(lambda *a: reference_quantize(*a, **p)[:6])
    return kernel, ref


def _pad(sizes, n=N):
    return np.concatenate([np.asarray(sizes, np.int64), np.zeros(n - len(sizes), np.int64)])


def _buffer(x, size=SIZE):
    """x flattened and padded to `size` elements with random values (a tail past the groups)."""
    x = np.asarray(x).reshape(-1)
    fill = np.random.default_rng(x.size).standard_normal(size - x.size).astype(x.dtype)
    return np.concatenate([x, fill])


def check_quantize(x, rows, cols, row_fmt, col_fmt, *, keys=None, amaxes=(None, None), what=""):
    """The six orientation outputs of the handler and the reference on the flat buffer x (traced sizes)."""
    x = jnp.asarray(x).reshape(-1)
    rows, cols = jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32)
    n = rows.shape[0]
    if keys is None:
        keys = np.random.default_rng(n).integers(0, 2**32, (2, n, 2), dtype=np.uint32)
    given = (1 if amaxes[0] is not None else 0) | (2 if amaxes[1] is not None else 0)
    amax_in = (jnp.concatenate([jnp.asarray(a if a is not None else np.zeros(n), jnp.float32) for a in amaxes])
               if given else jnp.zeros((0,), jnp.float32))
    args = (x, rows, cols, jnp.asarray(keys[0]), jnp.asarray(keys[1]), amax_in)
    kernel, ref = _quantize_fns(row_fmt, col_fmt, given)
    if x.size:
        _has_call(kernel, args, Q_TARGET)
    got, want = kernel(*args), ref(*args)
    assert_same_bits(got, want, f"{what} {row_fmt!r}/{col_fmt!r} rows={np.asarray(rows).tolist()} "
                                f"cols={np.asarray(cols).tolist()}")
    return want


def _sizes(rng, n, align, hi=5):
    """n multiples of `align` in [0, align * hi), about a quarter of them 0 (uneven, empty groups)."""
    s = align * rng.integers(1, hi, n)
    s[rng.random(n) < 0.25] = 0
    return s


def _aligned_dims(rng):
    """(rows, cols) of N groups with dims multiples of 32 (some empty) filling at most SIZE - 32 elements."""
    while True:
        rows, cols = _sizes(rng, N, 32, 3), _sizes(rng, N, 32, 4)
        if (rows * cols).sum() <= SIZE - 32:
            return rows, cols


ALIGNED_CASES = [  # (row_fmt, col_fmt, dtype): the handler's one-call pairings, and either orientation alone
    (_NV, _NV, jnp.bfloat16), (_NV_SR, _NV_RHT_SR, jnp.bfloat16), (_NV_RHT, _MX, jnp.float32),
    (_NV, _MX5, jnp.float16), (_MX, _MX, jnp.bfloat16), (_MX5, None, jnp.float16), (None, _NV_SR, jnp.float32),
]
_case_id = [f"{c[0]!r}-{c[1]!r}-{dtype_id(c[2])}" for c in ALIGNED_CASES]


@pytest.mark.parametrize("row_fmt,col_fmt,dtype", ALIGNED_CASES, ids=_case_id)
def test_quantize_aligned_groups(row_fmt, col_fmt, dtype):
    """Random aligned group sizes (empty groups, a tail past the last group; one group filling the buffer)."""
    rng = np.random.default_rng(ALIGNED_CASES.index((row_fmt, col_fmt, dtype)))
    for _ in range(2):
        rows, cols = _aligned_dims(rng)
        check_quantize(random_input(rng, (SIZE,), dtype), rows, cols, row_fmt, col_fmt, what="aligned")
    check_quantize(random_input(rng, (SIZE,), dtype), _pad([0, 128]), _pad([7, 128]), row_fmt, col_fmt, what="full")


MISALIGNED_CASES = [  # (rows, cols, row_fmt, col_fmt)
    # Columnwise misaligned token counts (MXFP8 groups 1-3, NVFP4 groups 2-3), offsets kept 32-aligned.
    ([32, 48, 40, 40], [32] * 4, _MX, _MX),
    ([32, 48, 40, 40, 16], [32] * 5, _NV_SR, _NV_RHT_SR),
    # Odd element counts: the aligned groups after them start at odd offsets (NVFP4 bytes shared by two groups), RHT
    # and SR streams on the generic path, a buffer tail.
    ([3, 32, 5, 0, 16, 7, 32], [5, 32, 16, 9, 48, 1, 64], _NV, _NV),
    ([3, 32, 5, 0, 16, 7, 32], [5, 32, 16, 9, 48, 1, 64], _NV_SR, _NV_RHT),
    ([3, 32, 5, 0, 16, 7, 32], [5, 32, 16, 9, 48, 1, 64], _NV_RHT_SR, _MX5),
    ([1, 32, 64, 33], [31, 64, 32, 32], _MX, _MX),
    ([64] * 4, [16, 24, 32, 40], _NV, _MX5),
    ([1, 1, 1, 16, 1], [1, 1, 17, 16, 3], _NV, _NV),  # one-element groups: a shared byte at each boundary
]


@pytest.mark.parametrize("rows,cols,row_fmt,col_fmt", MISALIGNED_CASES,
                         ids=[f"{i}-{c[2]!r}-{c[3]!r}" for i, c in enumerate(MISALIGNED_CASES)])
def test_quantize_misaligned_groups(rows, cols, row_fmt, col_fmt):
    """Poisoned groups (NaN scales / amax / MXFP8 data) and their E2M1 codes, and every later group, bit for bit."""
    rng = np.random.default_rng(len(rows))
    check_quantize(random_input(rng, (SIZE,), jnp.bfloat16), _pad(rows), _pad(cols), row_fmt, col_fmt,
                   what="misaligned")


def test_quantize_overrunning_groups():
    """Sizes summing past the buffer (and negative sizes): groups before the overrun equal the reference (the
    reference leaves the truncated group's values unspecified), every write stays inside the outputs."""
    kernel, ref = _quantize_fns(_NV, _NV, 0)
    rows, cols = _pad([16, -3, 80, 160]), _pad([32, 16, 64, 96])
    args = (jnp.asarray(random_input(np.random.default_rng(0), (SIZE,), jnp.bfloat16)), jnp.asarray(rows, jnp.int32),
            jnp.asarray(cols, jnp.int32), jnp.zeros((N, 2), jnp.uint32), jnp.zeros((N, 2), jnp.uint32),
            jnp.zeros((0,), jnp.float32))
    got, want = kernel(*args), ref(*args)
    fit = 16 * 32 + 80 * 64
    for o in (0, 3):
        assert_same_bits(got[o][:fit], want[o][:fit], "groups inside the buffer: data")
        assert_same_bits(got[o + 1][: fit // 16], want[o + 1][: fit // 16], "groups inside the buffer: scales")
        assert_same_bits(got[o + 2][:3], want[o + 2][:3], "groups inside the buffer: amax")


def test_quantize_empty_groups_and_buffer():
    """All groups empty (the whole buffer is tail), and a buffer of no elements."""
    rng = np.random.default_rng(1)
    for x in (random_input(rng, (SIZE,), jnp.bfloat16), np.zeros((0,), jnp.bfloat16)):
        check_quantize(x, np.zeros(N), np.full(N, 64), _NV, _NV, what=f"empty groups, x {x.shape}")
        check_quantize(x, np.full(N, 32), np.zeros(N), _MX, _MX, what=f"empty groups, x {x.shape}")


def _edge_groups():
    """float32 [SIZE] and the sizes of its groups: a 16x64 group of block-sized edge patterns at scales
    2^-149 .. 2^127 (E8M0 codes 0 .. 254, E2M1 ties and midpoints, E4M3 / E5M2 saturation, subnormals), an 8x32
    group of EDGE values (NaN / inf included) and a 64x32 group of normal values with one NaN and one inf."""
    grid = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, -6.0], np.float32)
    mids = np.nextafter(grid, np.float32(np.inf)).astype(np.float32)
    rows = []
    with np.errstate(over="ignore", invalid="ignore"):
        for i, e in enumerate(range(-149, 128, 18)):
            s = np.float32(2.0) ** np.float32(e) if e > -127 else np.float32(np.ldexp(1.0, e))
            base = (grid if i % 2 == 0 else mids) * s
            rows.append(np.concatenate([base, -base[::-1], base * np.float32(448.0 / 6), base * np.float32(57344.0)]))
    g0 = np.stack(rows).astype(np.float32)
    g1 = np.resize(np.concatenate([EDGE, [np.nan]]), (8, 32)).astype(np.float32)
    g2 = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    g2[5, 7], g2[40, 3] = np.nan, -np.inf
    x = _buffer(np.concatenate([g0.reshape(-1), g1.reshape(-1), g2.reshape(-1)]))
    return x, _pad([16, 8, 64]), _pad([64, 32, 32])


@pytest.mark.parametrize("row_fmt,col_fmt,dtype", [ALIGNED_CASES[i] for i in (2, 3, 4, 6)],
                         ids=[_case_id[i] for i in (2, 3, 4, 6)])
def test_quantize_edge_values(row_fmt, col_fmt, dtype):
    """Edge tables (subnormals, E8M0 extremes, saturation, NaN / Inf); the 8-row group is misaligned columnwise for
    MXFP8 (poisoned) and aligned for NVFP4."""
    x, rows, cols = _edge_groups()
    with np.errstate(over="ignore", invalid="ignore"):
        for scale in (1.0, 2.0**-100):
            check_quantize((x * np.float32(scale)).astype(dtype), rows, cols, row_fmt, col_fmt,
                           what=f"edge * {scale}")


def test_quantize_given_amax_and_sr_streams():
    """Given per-group amaxes (random, unlike the groups' own; zero and inf too) for either orientation, and SR with
    extreme per-group key words."""
    rng = np.random.default_rng(4)
    rows, cols = _pad([32, 0, 64, 48, 16]), _pad([64, 32, 32, 96, 16])
    x = random_input(rng, (SIZE,), jnp.bfloat16)
    a = rng.uniform(0.25, 16.0, N).astype(np.float32)
    a[3], a[4] = 0.0, np.inf
    for amaxes in ((a, None), (a, a[::-1].copy())):
        check_quantize(x, rows, cols, _NV_SR, _NV_RHT, amaxes=amaxes, what="given amax")
    check_quantize(x, _pad([3, 32, 5, 0, 16, 7]), _pad([5, 32, 16, 9, 48, 1]), _NV_SR, _NV_RHT, amaxes=(a, a),
                   what="given amax, misaligned groups")
    # A given rowwise amax is not the columnwise one (the handler shares computed plain amaxes between orientations).
    check_quantize(x, rows, cols, _NV, _NV, amaxes=(a, None), what="given rowwise amax")
    keys = np.zeros((2, N, 2), np.uint32)
    keys[0, :, 0], keys[1, :, 1] = 0xFFFFFFFF, 0xFFFFFFFF
    check_quantize(x, rows, cols, _NV_SR, _NV_RHT_SR, keys=keys, what="SR extreme keys")


def test_quantize_many_groups():
    """More groups than the CUDA kernel's table holds: the CPU handler takes them (no reference fallback)."""
    rng = np.random.default_rng(6)
    n = MAX_KERNEL_GROUPS + 5
    rows = np.zeros(n, np.int32)
    rows[rng.choice(n, 24, replace=False)] = rng.choice([16, 32, 48], 24)
    x = random_input(rng, (int(rows.sum()) * 32 + 64,), jnp.bfloat16)
    check_quantize(x, rows, np.full(n, 32), _NV, _MX, what=f"{n} groups")


@settings(max_examples=10, deadline=None)
@given(
    case=st.integers(0, len(ALIGNED_CASES) - 1),
    rows=st.lists(st.integers(-2, 60), min_size=N, max_size=N),
    col_mult=st.sampled_from([1, 16, 32]),
    scale_exp=st.integers(-140, 120),
    special=st.sampled_from(["none", "nan", "inf"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_quantize(case, rows, col_mult, scale_exp, special, seed):
    """Drawn group sizes (empty, negative, not multiples of the block), value scales, NaN / Inf, SR key words."""
    row_fmt, col_fmt, dt = ALIGNED_CASES[case]
    rng = np.random.default_rng(seed)
    cols = rng.integers(1, 25, N) if col_mult == 1 else col_mult * rng.integers(0, 32 // col_mult + 1, N)
    x = random_input(rng, (SIZE,), np.float32, scale_exp=scale_exp)
    if special != "none":
        x[rng.choice(SIZE, 40)] = np.nan if special == "nan" else -np.inf
    with np.errstate(over="ignore"):
        x = x.astype(dt)
    keys = rng.integers(0, 2**32, (2, N, 2), dtype=np.uint32)
    check_quantize(x, rows, cols, row_fmt, col_fmt, keys=keys, what=f"2^{scale_exp} {special}")


# ---- the public ops: representations, dbias, vmap ---------------------------------------------------------------
@pytest.mark.parametrize("rep", [R.VARYING_FIRST_DIM, R.VARYING_LAST_DIM], ids=lambda r: r.value)
def test_public_grouped_ops(rep):
    """grouped_quantize_rowwise_columnwise (+ dbias) and grouped_dequantize through the handlers, against the same
    functions inside ffi.reference_lowering_on_cpu()."""
    rng = np.random.default_rng(list(R).index(rep))
    n = 6
    if rep is R.VARYING_FIRST_DIM:
        rows, cols = _sizes(rng, n, 32), np.full(n, 96)
        shape, group_sizes, last_dims = (int(rows.sum()) + 32, 96), jnp.asarray(rows, jnp.int32), None
    else:
        rows, cols = np.full(n, 64), _sizes(rng, n, 32)
        shape, group_sizes, last_dims = (64, int(cols.sum()) + 32), None, jnp.asarray(cols, jnp.int32)
    x = random_input(rng, shape, jnp.bfloat16)

    def f(x, key):
        row, col, db = jax_fp4.grouped_quantize_rowwise_columnwise(
            x, group_sizes, NVFP4(rht=True, stochastic_rounding=True), MXFP8(), key=key, last_dims=last_dims,
            dbias=True)
        return row, col, db, jax_fp4.grouped_dequantize(row, jnp.bfloat16), jax_fp4.grouped_dequantize(col)

    key = jax.random.key(3)
    _has_call(f, (x, key), Q_TARGET)
    _has_call(f, (x, key), DQ_TARGET)
    got = jax.jit(f)(x, key)
    with ffi.reference_lowering_on_cpu():
        want = jax.jit(f)(x, key)
    assert_same_bits([got[i] for i in (0, 1, 3, 4)], [want[i] for i in (0, 1, 3, 4)], rep.value)
    xf = np.asarray(x, np.float32).reshape(-1)
    off, coff = np.concatenate([[0], np.cumsum(rows * cols)]), np.concatenate([[0], np.cumsum(cols)])
    for g in range(n):
        if cols[g]:
            db = got[2][coff[g] : coff[g + 1]] if rep is R.VARYING_LAST_DIM else got[2][g]
            assert_dbias_close(db, xf[off[g] : off[g + 1]].reshape(rows[g], cols[g]), f"dbias group {g}")


def test_vmap():
    """vmap (lax.map over examples) runs the handlers per example."""
    rng = np.random.default_rng(9)
    rows = np.array([32, 0, 64, 16], np.int32)
    xb = np.stack([random_input(rng, (128, 64), jnp.bfloat16) for _ in range(3)])
    keys = jax.random.split(jax.random.key(2), 3)

    def f(xb, fd, keys):
        def one(x, key):
            q = jax_fp4.grouped_quantize(x, fd, NVFP4(stochastic_rounding=True), key=key)
            return q, jax_fp4.grouped_dequantize(q, jnp.bfloat16)

        return jax.vmap(one)(xb, keys)

    _has_call(f, (xb, rows, keys), Q_TARGET)
    got = jax.jit(f)(xb, rows, keys)
    with ffi.reference_lowering_on_cpu():
        want = jax.jit(f)(xb, rows, keys)
    assert_same_bits(got, want, "vmap")


def test_handler_rejects_unsupported_options():
    """A call the handler does not serve (NVFP4 2D scaling, a single-tensor option) is an error naming the options,
    not a wrong result."""
    n, size = 2, 256
    shapes = quantize_result_shapes(size, n, _NV, None)
    call = jax.ffi.ffi_call(Q_TARGET, shapes)
    attrs = dict(row_kind=np.int32(Kind.NVFP4), col_kind=np.int32(Kind.NONE),
                 flags=np.int32(QuantizeOption.SCALING_2D), amax_given=np.int32(0))
    args = (jnp.zeros((size,), jnp.float32), jnp.full((n,), 8, jnp.int32), jnp.full((n,), 16, jnp.int32),
            jnp.zeros((n, 2), jnp.uint32), jnp.zeros((n, 2), jnp.uint32), jnp.zeros((0,), jnp.float32))
    with pytest.raises(Exception, match="unsupported options 4"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(*args))


# ---- dequantize -----------------------------------------------------------------------------------------------------
@functools.cache
def _dequantize_fns(fmt, axis, size, out_dtype, raw):
    p = dict(fmt=fmt, axis=axis, x_shape=(size,), out_dtype=jnp.dtype(out_dtype), raw=raw)
    kernel = jax.jit(lambda *a: grouped_dequantize_p.bind(*a, **p))
    ref = jax.jit(lambda *a: reference_dequantize(*a, **p))
    return kernel, ref


def check_dequantize(data, scale, amax, rows, cols, fmt, axis, variants=None, what=""):
    """The handler against the reference for each (output dtype, raw) variant: by default every output dtype, and
    raw (float32) for NVFP4."""
    size = int(np.asarray(data).size)
    if variants is None:
        variants = [(dt, False) for dt in OUT_DTYPES] + ([(jnp.float32, True)] if isinstance(fmt, NVFP4) else [])
    for dt, raw in variants:
        a = jnp.zeros((0,), jnp.float32) if raw or amax is None else jnp.asarray(amax, jnp.float32)
        args = (jnp.asarray(data), jnp.asarray(scale), a, jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32))
        kernel, ref = _dequantize_fns(fmt, axis, size, dt, raw)
        if size:
            _has_call(kernel, args, DQ_TARGET)
        sizes = f"rows={np.asarray(rows).tolist()} cols={np.asarray(cols).tolist()}"
        assert_same_bits(kernel(*args), ref(*args), f"{what} {fmt!r} axis {axis} {dtype_id(dt)} raw={raw} {sizes}")


def random_codes(rng, fmt, size, n):
    """(data, scale, amax): every E2M1 / FP8 code, scales with NaN, zero and extreme codes, amax with zeros / inf."""
    if isinstance(fmt, NVFP4):
        data = rng.integers(0, 16, size).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
        scale = rng.integers(0, 256, size // 16).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        amax = np.abs(rng.standard_normal(n)).astype(np.float32) * 100
        amax[rng.random(n) < 0.2] = 0
        amax[rng.random(n) < 0.1] = np.inf
        return data, scale, amax
    data = rng.integers(0, 256, size).astype(np.uint8).view(fmt.data_dtype)
    scale = rng.integers(100, 160, size // 32).astype(np.uint8)
    scale[rng.random(scale.size) < 0.05] = rng.choice([0, 1, 0xFD, 0xFE, 0xFF])
    return data, scale.view(ml_dtypes.float8_e8m0fnu), None


DEQUANT_FORMATS = [(_NV, -1), (_NV, 0), (_NV_RHT, -1), (_NV_RHT, 0), (_MX, -1), (_MX, 0), (_MX5, -1), (_MX5, 0)]


@pytest.mark.parametrize("fmt,axis", DEQUANT_FORMATS, ids=[f"{f!r}-axis{a}" for f, a in DEQUANT_FORMATS])
def test_dequantize_random_codes(fmt, axis):
    """Random codes (every code, NaN scales) of aligned groups with empty groups and a tail, then of misaligned groups
    at odd offsets (the generic path)."""
    rng = np.random.default_rng(DEQUANT_FORMATS.index((fmt, axis)))
    rows, cols = _aligned_dims(rng)
    check_dequantize(*random_codes(rng, fmt, SIZE, N), rows, cols, fmt, axis, what="aligned")
    rows, cols = _pad([3, 32, 5, 0, 16, 7, 32, 1]), _pad([5, 32, 16, 9, 48, 1, 64, 33])
    check_dequantize(*random_codes(rng, fmt, SIZE, N), rows, cols, fmt, axis, what="misaligned")


def test_dequantize_of_quantized():
    """The handler's dequantize of the handler's quantize (misaligned groups included) equals the reference's."""
    rows, cols = _pad([3, 32, 5, 0, 16, 7, 32]), _pad([5, 32, 16, 9, 48, 1, 64])
    x = random_input(np.random.default_rng(3), (SIZE,), jnp.bfloat16)
    q = check_quantize(x, rows, cols, _NV_RHT_SR, _MX5, what="round trip")
    check_dequantize(*q[:3], rows, cols, NVFP4(rht=True), -1, what="round trip")  # SR leaves the decode unchanged
    check_dequantize(q[3], q[4], None, rows, cols, _MX5, 0, what="round trip")


@settings(max_examples=10, deadline=None)
@given(
    fmt_i=st.integers(0, len(DEQUANT_FORMATS) - 1),
    rows=st.lists(st.integers(-1, 60), min_size=N, max_size=N),
    col_mult=st.sampled_from([1, 16, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_dequantize(fmt_i, rows, col_mult, seed):
    """Drawn group sizes (empty, negative, not multiples of the block) of random codes."""
    rng = np.random.default_rng(seed)
    fmt, axis = DEQUANT_FORMATS[fmt_i]
    cols = rng.integers(1, 25, N) if col_mult == 1 else col_mult * rng.integers(0, 32 // col_mult + 1, N)
    check_dequantize(*random_codes(rng, fmt, SIZE, N), rows, cols, fmt, axis, [(jnp.float32, False)], "hypothesis")
