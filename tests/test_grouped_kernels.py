"""The CUDA grouped kernels (`jf4_grouped_quantize`, `jf4_grouped_dequantize` FFI targets) against the reference.

Every test runs the same jitted function on the GPU (the CUDA lowering; its HLO must hold the custom call, so a test
cannot silently pass on the reference) and on the CPU device (where the grouped primitives lower to
`jax_fp4.reference.grouped`), and asserts equal bits for every output leaf (first differing flat index and both
codes on failure). The grouped dbias is an fp32 sum in an unspecified order: checked against the float64 column sums
within the fp32 summation bound instead.

Coverage: the four shape representations with traced, random, uneven group sizes (empty groups included) for 1, 8
and 64 groups and a buffer tail past the last group; NVFP4 (plain, RHT, stochastic rounding) and MXFP8 (E4M3, E5M2)
in both orientations, the fused pairings and the two-launch ones; bf16 / f16 / f32 inputs; dequantize of random
codes (NaN scales included) to every output dtype, raw (the GEMM emulation's operand) too; traced misaligned groups
(poisoned, and the groups after them at odd / unaligned offsets) bit for bit, E2M1 codes included; outputs aliased to
poisoned buffers (every byte written); vmap; the reference fallback past 1024 groups.

All tests are marked `gpu` (skipped where jax's default backend is not a GPU). Replay a failure with the session seed
printed in the pytest header: JAX_FP4_SEED=<seed>.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _cmd_buffer_util import assert_command_buffer_runs
from _quantize_util import assert_dbias_close, assert_leaf_bits, assert_same_bits, dtype_id, random_input

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi
from jax_fp4._src.primitives.grouped import (
    MAX_KERNEL_GROUPS,
    dequantize_flags,
    grouped_dequantize_raw,
    quantize_flags,
    quantize_result_shapes,
    reference_quantize,
)
from jax_fp4.reference.grouped import Representation as R

pytestmark = pytest.mark.gpu

Q_TARGET, DQ_TARGET = "jf4_grouped_quantize", "jf4_grouped_dequantize"
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ALIGN = 32  # a multiple of both block sizes: random sizes aligned for every format and orientation


# ---- running on both devices -----------------------------------------------------------------------------------------
def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def assert_custom_calls(fn, args, present=(Q_TARGET,), absent=()):
    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    text = jax.jit(fn).lower(*jax.device_put(args, _gpu())).as_text()
    for name in present:
        assert re.search(rf"custom_call\s*@{name}\b", text), f"no {name} custom call in the GPU HLO:\n{text[:20000]}"
    for name in absent:
        assert not re.search(rf"custom_call\s*@{name}\b", text), f"unexpected {name} custom call in the GPU HLO"


def run_on(device, fn, *args):
    out = jax.jit(fn)(*jax.device_put(args, device))
    return jax.device_get(out)


def gpu_vs_cpu(fn, *args, present=(Q_TARGET,), absent=(), what=""):
    """The GPU lowering holds the custom calls, and GPU bits == CPU (reference) bits; returns (gpu, cpu)."""
    assert_custom_calls(fn, args, present, absent)
    got, want = run_on(_gpu(), fn, *args), run_on(_cpu(), fn, *args)
    assert_same_bits(got, want, what)
    return got, want


# ---- random grouped problems -----------------------------------------------------------------------------------------
def _sizes(rng, n, hi=5):
    """n multiples of ALIGN in [0, ALIGN * hi), about a quarter of them 0 (uneven, empty groups)."""
    s = ALIGN * rng.integers(1, hi, n)
    s[rng.random(n) < 0.25] = 0
    return s


def draw(rng, rep, n):
    """(x shape, rows, cols): random group dims of `rep` and a buffer with a tail past the last group."""
    tail = int(rng.integers(0, 3)) * ALIGN
    if rep is R.SAME_BOTH_DIMS:
        m, k = ALIGN * int(rng.integers(1, 3)), ALIGN * int(rng.integers(1, 5))
        return (n * m, k), np.full(n, m), np.full(n, k)
    if rep is R.VARYING_FIRST_DIM:
        k = int(rng.choice([32, 96, 160]))
        rows = _sizes(rng, n)
        return (int(rows.sum()) + tail, k), rows, np.full(n, k)
    if rep is R.VARYING_LAST_DIM:
        m = ALIGN * int(rng.integers(1, 4))
        cols = _sizes(rng, n)
        return (m, int(cols.sum()) + tail), np.full(n, m), cols
    rows, cols = _sizes(rng, n, 4), _sizes(rng, n, 4)
    return (int((rows * cols).sum()) + tail * ALIGN,), rows, cols


def group_args(rep, n, fd, ld):
    """grouped_quantize's (group_sizes, last_dims) for a representation (fd / ld traced arrays)."""
    return {R.SAME_BOTH_DIMS: (n, None), R.VARYING_FIRST_DIM: (fd, None), R.VARYING_LAST_DIM: (None, ld),
            R.VARYING_BOTH_DIMS: (fd, ld)}[rep]


def _rc_fn(rep, n, row_fmt, col_fmt, dbias):
    def f(x, fd, ld, key):
        gs, last = group_args(rep, n, fd, ld)
        return jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, row_fmt, col_fmt, last_dims=last, key=key,
                                                           dbias=dbias)

    return f


def check_dbias(db, x, rows, cols, rep):
    """The GPU dbias of every group against its float64 column sums (fp32 summation bound)."""
    xf = np.asarray(x, np.float32).reshape(-1)
    off = np.concatenate([[0], np.cumsum(rows * cols)])
    coff = np.concatenate([[0], np.cumsum(cols)])
    for g in range(len(rows)):
        xg = xf[off[g] : off[g + 1]].reshape(rows[g], cols[g])
        got = db[coff[g] : coff[g + 1]] if rep is R.VARYING_LAST_DIM else db[g]
        if cols[g]:
            assert_dbias_close(got, xg, f"dbias group {g}")


# ---- quantize: every representation, pairing, group count ------------------------------------------------------------
_NV, _NV_SR, _NV_RHT = NVFP4(), NVFP4(stochastic_rounding=True), NVFP4(rht=True)
_MX, _MX5 = MXFP8(), MXFP8(element="e5m2")
QUANT_CASES = [  # (representation, N, row_fmt, col_fmt, dtype)
    (R.SAME_BOTH_DIMS, 1, _NV, _NV, jnp.bfloat16),
    (R.SAME_BOTH_DIMS, 8, _MX, _MX, jnp.float16),
    (R.SAME_BOTH_DIMS, 64, _NV, _MX5, jnp.bfloat16),
    (R.VARYING_FIRST_DIM, 1, _MX5, _MX5, jnp.float32),
    (R.VARYING_FIRST_DIM, 8, _NV, _NV, jnp.bfloat16),
    (R.VARYING_FIRST_DIM, 8, _NV_SR, NVFP4(rht=True, stochastic_rounding=True), jnp.bfloat16),
    (R.VARYING_FIRST_DIM, 64, _NV, _MX, jnp.bfloat16),  # the NVFP4-forward / MXFP8-backward recipe
    (R.VARYING_FIRST_DIM, 64, _MX, _MX, jnp.float16),
    (R.VARYING_FIRST_DIM, 8, _MX, _NV, jnp.float32),  # two launches
    (R.VARYING_LAST_DIM, 1, _NV_RHT, None, jnp.bfloat16),
    (R.VARYING_LAST_DIM, 8, _MX, _MX5, jnp.bfloat16),  # two launches
    (R.VARYING_LAST_DIM, 64, _NV, _NV_RHT, jnp.float32),
    (R.VARYING_BOTH_DIMS, 1, None, _NV, jnp.float16),
    (R.VARYING_BOTH_DIMS, 8, _NV_SR, _NV_SR, jnp.bfloat16),
    (R.VARYING_BOTH_DIMS, 64, _MX, None, jnp.bfloat16),
    (R.VARYING_BOTH_DIMS, 64, None, _MX5, jnp.float32),
]


@pytest.mark.parametrize(
    "rep,n,row_fmt,col_fmt,dtype", QUANT_CASES,
    ids=[f"{c[0].value}-N{c[1]}-{c[2]!r}-{c[3]!r}-{dtype_id(c[4])}" for c in QUANT_CASES],
)
def test_grouped_quantize_matches_reference(rng, rep, n, row_fmt, col_fmt, dtype):
    shape, rows, cols = draw(rng, rep, n)
    x = random_input(rng, shape, dtype)
    dbias = rep is not R.VARYING_BOTH_DIMS
    f = _rc_fn(rep, n, row_fmt, col_fmt, dbias)
    args = (x, rows.astype(np.int32), cols.astype(np.int32), jax.random.key(int(rng.integers(2**31))))
    assert_custom_calls(f, args)
    got, want = run_on(_gpu(), f, *args), run_on(_cpu(), f, *args)
    assert_same_bits(got[:2], want[:2], f"{rep.value} N={n} rows={rows.tolist()} cols={cols.tolist()}")
    if dbias:
        check_dbias(got[2], x, rows, cols, rep)


def test_empty_groups_and_empty_buffer(rng):
    """All groups empty (the whole buffer is tail), and a buffer of no elements."""
    f = _rc_fn(R.VARYING_FIRST_DIM, 8, _NV, _MX, False)
    z = np.zeros(8, np.int32)
    for x in (random_input(rng, (64, 64), jnp.bfloat16), np.zeros((0, 64), jnp.bfloat16)):
        gpu_vs_cpu(f, x, z, np.full(8, 64, np.int32), jax.random.key(0), what=f"empty groups, x {x.shape}")


# ---- traced misaligned groups: poisoned like the reference, the others exact -----------------------------------------
MISALIGNED_CASES = [  # (representation, rows, cols, x shape, row_fmt, col_fmt)
    # Columnwise over the tokens: MXFP8 poisons groups 1-3, NVFP4 groups 2-3 (offsets stay 32-aligned).
    (R.VARYING_FIRST_DIM, [32, 48, 40, 40], [32] * 4, (192, 32), None, _MX),
    (R.VARYING_FIRST_DIM, [32, 48, 40, 40, 16], [32] * 5, (192, 32), _NV, _NV_RHT),
    # Odd element counts: the aligned groups after them start at odd / unaligned offsets (NVFP4 bytes shared by
    # two groups), RHT and SR streams on the generic path, a buffer tail.
    (R.VARYING_BOTH_DIMS, [3, 32, 5, 0, 16, 7, 32], [5, 32, 16, 9, 48, 1, 64], (4200,), _NV, _NV),
    (R.VARYING_BOTH_DIMS, [3, 32, 5, 0, 16, 7, 32], [5, 32, 16, 9, 48, 1, 64], (4200,), _NV_SR, _NV_RHT),
    (R.VARYING_BOTH_DIMS, [1, 32, 64, 33], [31, 64, 32, 32], (6200,), _MX, _MX),
    (R.VARYING_LAST_DIM, [64] * 4, [16, 24, 32, 40], (64, 120), _NV, _MX5),
]


@pytest.mark.parametrize("rep,rows,cols,shape,row_fmt,col_fmt", MISALIGNED_CASES,
                         ids=[f"{c[0].value}-{c[4]!r}-{c[5]!r}" for c in MISALIGNED_CASES])
def test_traced_misaligned_groups_match_reference(rng, rep, rows, cols, shape, row_fmt, col_fmt):
    """Poisoned groups (NaN scales / amax / MXFP8 data) and their E2M1 codes, and every later group, bit for bit;
    then the grouped dequantize of both results (raw too)."""
    rows, cols = np.asarray(rows, np.int32), np.asarray(cols, np.int32)
    n = len(rows)
    x = random_input(rng, shape, jnp.bfloat16)
    f = _rc_fn(rep, n, row_fmt, col_fmt, False)
    key = jax.random.key(5)
    got, want = gpu_vs_cpu(f, x, rows, cols, key, what=f"misaligned {rep.value} rows={rows} cols={cols}")
    for gq in want[:2]:
        if gq is None:
            continue
        for dtype in OUT_DTYPES:
            for raw in (False, True) if isinstance(gq.fmt, NVFP4) else (False,):
                def deq(gq, dtype=dtype, raw=raw):
                    return jax_fp4.grouped_dequantize(gq, dtype, raw=raw)

                gpu_vs_cpu(deq, gq, present=(DQ_TARGET,), what=f"dequantize {gq.fmt!r} axis {gq.axis} raw={raw}")


# ---- dequantize: random codes, every output dtype --------------------------------------------------------------------
def random_codes(rng, fmt, size, n):
    """(data, scale, amax) of random codes: every E2M1 / FP8 code, E4M3 / E8M0 scales with NaN, zero and extreme
    codes, amax with zeros."""
    if isinstance(fmt, NVFP4):
        data = rng.integers(0, 16, size).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
        scale = rng.integers(0, 256, size // 16).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        amax = np.abs(rng.standard_normal(n)).astype(np.float32) * 100
        amax[rng.random(n) < 0.2] = 0
        return data, scale, amax
    data = rng.integers(0, 256, size).astype(np.uint8).view(fmt.data_dtype)
    scale = rng.integers(100, 160, size // 32).astype(np.uint8)
    scale[rng.random(scale.size) < 0.05] = rng.choice([0, 1, 0xFD, 0xFE, 0xFF])
    return data, scale.view(ml_dtypes.float8_e8m0fnu), None


DEQUANT_CASES = [  # (fmt, axis, representation, N)
    (_NV, -1, R.VARYING_FIRST_DIM, 8),
    (_NV, 0, R.VARYING_FIRST_DIM, 64),
    (_NV_RHT, 0, R.VARYING_LAST_DIM, 8),
    (_NV_RHT, -1, R.VARYING_BOTH_DIMS, 64),
    (_NV, 0, R.SAME_BOTH_DIMS, 1),
    (_MX, -1, R.VARYING_FIRST_DIM, 64),
    (_MX, 0, R.VARYING_FIRST_DIM, 8),
    (_MX5, 0, R.VARYING_BOTH_DIMS, 8),
    (_MX5, -1, R.SAME_BOTH_DIMS, 64),
    (_MX, 0, R.VARYING_LAST_DIM, 1),
]


@pytest.mark.parametrize("fmt,axis,rep,n", DEQUANT_CASES,
                         ids=[f"{c[0]!r}-axis{c[1]}-{c[2].value}-N{c[3]}" for c in DEQUANT_CASES])
def test_grouped_dequantize_matches_reference(rng, fmt, axis, rep, n):
    shape, rows, cols = draw(rng, rep, n)
    size = int(np.prod(shape))
    data, scale, amax = random_codes(rng, fmt, size, n)
    args = (data, scale, amax, rows.astype(np.int32), cols.astype(np.int32))
    for dtype in OUT_DTYPES:
        for raw in (False, True) if isinstance(fmt, NVFP4) else (False,):
            def f(data, scale, amax, fd, ld, dtype=dtype, raw=raw):
                return grouped_dequantize_raw(data, scale, amax, fd, ld, fmt=fmt, axis=axis, x_shape=shape,
                                              out_dtype=dtype, raw=raw)

            gpu_vs_cpu(f, *args, present=(DQ_TARGET,), what=f"{fmt!r} axis {axis} {dtype_id(dtype)} raw={raw}")


def test_quantize_dequantize_round_trip(rng):
    """The GPU dequantize of the GPU quantize equals the reference's composition (NVFP4 with RHT, MXFP8 columnwise)."""
    shape, rows, cols = draw(rng, R.VARYING_FIRST_DIM, 8)
    x = random_input(rng, shape, jnp.bfloat16)

    def f(x, fd, key):
        row, col, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, fd, NVFP4(rht=True), MXFP8(), key=key)
        return [jax_fp4.grouped_dequantize(q, d) for q in (row, col) for d in OUT_DTYPES]

    gpu_vs_cpu(f, x, rows.astype(np.int32), jax.random.key(1), present=(Q_TARGET, DQ_TARGET), what="round trip")


# ---- poisoned outputs: every byte written ----------------------------------------------------------------------------
def _poison(s):
    """A buffer of s's shape and dtype with every bit set (float4: every nibble 0xF; f32 / f16 / bf16: NaN bits)."""
    dt = jnp.dtype(s.dtype)
    if dt.name.startswith("float4"):
        return jax.lax.bitcast_convert_type(jnp.full(s.shape, 15, jnp.uint4), dt)
    udt = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize]
    return jax.lax.bitcast_convert_type(jnp.full(s.shape, jnp.iinfo(udt).max, udt), dt)


POISON_CASES = [  # (rows, cols, x shape, row_fmt, col_fmt): aligned with a tail, and misaligned odd offsets
    ([64, 0, 96, 32], [64] * 4, (256, 64), _NV, _NV),
    ([64, 0, 96, 32], [64] * 4, (256, 64), _MX, _MX),
    ([3, 32, 5, 16], [5, 32, 16, 48], (2100,), _NV_RHT, _NV),
    ([1, 32, 64], [31, 64, 32], (4200,), None, _MX5),
]


GIVEN_AMAX_CASES = [  # (representation, N, row_fmt, col_fmt, which amaxes are given: 1 row, 2 col)
    (R.VARYING_FIRST_DIM, 8, _NV, _NV, 3),
    (R.VARYING_FIRST_DIM, 8, _NV, _NV, 2),  # the rowwise amax computed, the columnwise one given
    (R.VARYING_FIRST_DIM, 64, _NV, _MX, 1),  # the recipe's pairing, kernel mode
    (R.SAME_BOTH_DIMS, 8, _NV_SR, _NV_RHT, 3),
    (R.VARYING_LAST_DIM, 8, _MX, _NV, 2),  # two launches
    (R.VARYING_BOTH_DIMS, 8, None, _NV_RHT, 2),
]


@pytest.mark.parametrize("rep,n,row_fmt,col_fmt,given", GIVEN_AMAX_CASES,
                         ids=[f"{c[0].value}-N{c[1]}-{c[2]!r}-{c[3]!r}-given{c[4]}" for c in GIVEN_AMAX_CASES])
def test_given_amax_matches_reference(rng, rep, n, row_fmt, col_fmt, given):
    """Given per-group amaxes (random, so unlike the groups' own) skip the amax pass for their orientation."""
    shape, rows, cols = draw(rng, rep, n)
    x = random_input(rng, shape, jnp.bfloat16)
    amaxes = [jnp.asarray(rng.uniform(0.25, 16.0, n), jnp.float32) if given & b else None for b in (1, 2)]

    def f(x, fd, ld, key, ra, ca):
        gs, last = group_args(rep, n, fd, ld)
        return jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, row_fmt, col_fmt, last_dims=last, key=key,
                                                           row_amax=ra, col_amax=ca)[:2]

    args = (x, rows.astype(np.int32), cols.astype(np.int32), jax.random.key(int(rng.integers(2**31))), *amaxes)
    assert_custom_calls(f, args)
    got, want = run_on(_gpu(), f, *args), run_on(_cpu(), f, *args)
    assert_same_bits(got, want, f"{rep.value} N={n} given={given} rows={rows.tolist()} cols={cols.tolist()}")
    for q, a in zip(got, amaxes, strict=True):
        if a is not None:
            ok = np.asarray(q.first_dims if q.axis == 0 else q.last_dims) % 16 == 0
            assert_same_bits(np.asarray(q.amax)[ok], np.asarray(a)[ok], "the given amax is returned")


@pytest.mark.parametrize("rows,cols,shape,row_fmt,col_fmt", POISON_CASES,
                         ids=[f"{c[2]}-{c[3]!r}-{c[4]!r}" for c in POISON_CASES])
def test_poisoned_outputs_fully_written(rng, rows, cols, shape, row_fmt, col_fmt):
    """Call both FFI targets directly with their outputs aliased to poisoned buffers (extra operands)."""
    assert ffi.HAS_CUDA_KERNELS, f"GPU test without the CUDA extension: {ffi.import_error()}"
    rows, cols = np.asarray(rows, np.int32), np.asarray(cols, np.int32)
    n, size = len(rows), int(np.prod(shape))
    x = random_input(rng, shape, jnp.float32)
    keys = np.asarray(rng.integers(0, 2**32, (2, n, 2)), np.uint32)
    shapes = quantize_result_shapes(size, n, row_fmt, col_fmt)
    call = jax.ffi.ffi_call(Q_TARGET, shapes, input_output_aliases={6 + i: i for i in range(6)})

    def poisoned(x, fd, ld, kr, kc, am):
        return call(x, fd, ld, kr, kc, am, *[_poison(s) for s in shapes[:6]],
                    **quantize_flags(row_fmt, col_fmt))[:6]

    params = dict(row_fmt=row_fmt, col_fmt=col_fmt, representation=R.VARYING_BOTH_DIMS, dbias=False, amax_given=0)
    args = (x, rows, cols, keys[0], keys[1], np.zeros(0, np.float32))
    got = run_on(_gpu(), poisoned, *args)
    want = run_on(_cpu(), lambda *a: reference_quantize(*a, **params)[:6], *args)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_leaf_bits(g, w, f"poisoned quantize result {i}")
    for fmt, axis, (data, scale, amax) in ((row_fmt, -1, want[:3]), (col_fmt, 0, want[3:])):
        if fmt is None:
            continue
        for dtype in OUT_DTYPES:
            out = jax.ShapeDtypeStruct(shape, dtype)
            dcall = jax.ffi.ffi_call(DQ_TARGET, out, input_output_aliases={5: 0})
            amax_in = amax if isinstance(fmt, NVFP4) else np.zeros(0, np.float32)

            def dq(data, scale, amax, fd, ld, fmt=fmt, axis=axis, dcall=dcall, out=out):
                return dcall(data, scale, amax, fd, ld, _poison(out), **dequantize_flags(fmt, axis, False))

            def ref(data, scale, amax, fd, ld, fmt=fmt, axis=axis, dtype=dtype):
                return grouped_dequantize_raw(data, scale, amax, fd, ld, fmt=fmt, axis=axis, x_shape=shape,
                                              out_dtype=dtype)

            dargs = (data, scale, amax_in, rows, cols)
            assert_leaf_bits(run_on(_gpu(), dq, *dargs), run_on(_cpu(), ref, *dargs),
                             f"poisoned dequantize {fmt!r} axis {axis} {dtype_id(dtype)}")


# ---- batching, fallback ----------------------------------------------------------------------------------------------
def test_vmap_runs_the_kernel_per_example(rng):
    """vmap (lax.map over examples): the kernel inside the loop, each example equal to the reference."""
    shape, rows, _ = draw(rng, R.VARYING_FIRST_DIM, 8)
    xb = np.stack([random_input(rng, shape, jnp.bfloat16) for _ in range(3)])
    keys = jax.random.split(jax.random.key(2), 3)

    def f(xb, fd, keys):
        def one(x, key):
            q = jax_fp4.grouped_quantize(x, fd, NVFP4(stochastic_rounding=True), key=key)
            return q, jax_fp4.grouped_dequantize(q, jnp.bfloat16)

        return jax.vmap(one)(xb, keys)

    gpu_vs_cpu(f, xb, rows.astype(np.int32), keys, present=(Q_TARGET, DQ_TARGET), what="vmap")


def test_more_groups_than_the_kernel_table_use_the_reference(rng):
    n = MAX_KERNEL_GROUPS + 1
    rows = np.zeros(n, np.int32)
    rows[rng.choice(n, 16, replace=False)] = 32
    x = random_input(rng, (int(rows.sum()) + 64, 32), jnp.bfloat16)
    def f(x, fd):
        return jax_fp4.grouped_quantize(x, fd, NVFP4(), axis=0)

    gpu_vs_cpu(f, x, rows, present=(), absent=(Q_TARGET,), what="1025 groups")


# ---- XLA command buffers (CUDA graphs) -------------------------------------------------------------------------------
def command_buffer_args(seed):
    """x[640, 192] (bf16) and group sizes (traced in the workload), one of them empty."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(rng.permutation([0, 96, 160, 384]), np.int32)
    return random_input(rng, (640, 192), jnp.bfloat16), sizes


def command_buffer_workload(args):
    """The mixed pairing (memset of the amax scratch and the counter, amax kernel, quantize), MXFP8 rowwise (memset of
    the counter, quantize) and a grouped dequantize, every group size traced."""
    x, sizes = args
    row, col, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, sizes, NVFP4(), MXFP8())
    mx = jax_fp4.grouped_quantize(x, sizes, MXFP8())
    return row, col, mx, jax_fp4.grouped_dequantize(row, jnp.bfloat16)


def test_command_buffers(rng):
    """Grouped quantize / dequantize inside jit three times with XLA command buffers capturing the custom calls (CUDA
    graphs: the graph replays the memsets that zero the scheduling counter), in a subprocess; the bits must be the CPU
    reference's."""
    assert_command_buffer_runs(command_buffer_args, command_buffer_workload, int(rng.integers(2**31)),
                               (Q_TARGET, DQ_TARGET))
