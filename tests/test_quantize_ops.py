"""The quantize ops layer on the CPU (where `jf4_quantize` and `jf4_rht_amax` lower to the bit-exact reference).

* `quantize_rowwise_columnwise` == the two separate `quantize` calls, bit for bit, for every format pairing;
* public `quantize` == `jax_fp4.reference.quantize` (+ `reference.swizzle_scales`) for every format and orientation;
* dbias within the fp32 summation bound; vmap == per-example calls; lax.scan == per-slice calls; jit == eager;
* eval_shape gives the documented shapes; trace-time ValueErrors name the shape; `rht_amax` == the reference.

About a minute on two cores: small shapes, one jit compilation per case, the separate quantize calls shared.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantize_util import (
    FORMATS,
    PAIRS,
    assert_dbias_close,
    assert_leaf_bits,
    assert_same_bits,
    bits,
    dtype_id,
    fmt_id,
    jq,
    jquantize_rc,
    needs_key,
    pair_id,
    random_input,
    split_quantize,
    vmap_marks,
)

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src.primitives.quantize import OUTPUT_NAMES, quantize_3d
from jax_fp4._src.primitives.rht_amax import rht_amax

KEY = jax.random.key(20240611)


# ---- quantize_rowwise_columnwise == two quantize calls ---------------------------------------------------------------
# The separate calls go through `jq` (jax.jit per shape and format): the 2-D [64, 128] bfloat16 ones are shared with
# test_quantize_equals_reference, test_vmap_equals_per_example and the scan test, which keeps this module fast.
RC_CASES = [(p, (64, 128), jnp.bfloat16, "compact") for p in PAIRS] + [
    # rank 3 (col of x.reshape(96, 64)), float16, swizzled scales
    ((MXFP8(), MXFP8(element="e5m2")), (2, 48, 64), jnp.float16, "swizzled"),
]


@pytest.mark.parametrize(
    "pair,shape,dtype,layout", RC_CASES,
    ids=[f"{pair_id(c[0])}-{c[1]}-{dtype_id(c[2])}-{c[3]}" for c in RC_CASES],
)
def test_rowwise_columnwise_equals_separate_quantize(rng, pair, shape, dtype, layout):
    row_fmt, col_fmt = pair
    x = random_input(rng, shape, dtype)
    key = KEY if needs_key(row_fmt, col_fmt) else None
    got = jquantize_rc(x, row_fmt, col_fmt, key, layout)
    assert got[2] is None  # no dbias requested
    want = split_quantize(x, row_fmt, col_fmt, KEY, layout)
    assert_same_bits(got[:2], want, "(row, col)")
    m, k = int(np.prod(shape[:-1])), shape[-1]
    if row_fmt is not None:
        assert got[0].shape == shape and got[0].axis == -1 and got[0].scale_layout == layout
    if col_fmt is not None:
        assert got[1].shape == (m, k) and got[1].axis == -2 and got[1].scale_layout == layout
    if key is not None:  # the rowwise stream is split(key)[0], the columnwise one split(key)[1]: not interchangeable
        k0, k1 = jax.random.split(key)
        assert not np.array_equal(bits(got[0].data), bits(jq(x, row_fmt, -1, k1).data))
        assert not np.array_equal(bits(got[1].data), bits(jq(x.reshape(m, k), col_fmt, 0, k0).data))


# ---- public quantize == jax_fp4.reference ----------------------------------------------------------------------------
def _check_against_reference(q, ref, fmt, axis, layout, what):
    assert q.fmt == fmt and q.axis == axis and q.scale_layout == layout, (q, what)
    assert_leaf_bits(q.data, ref.data, f"{what} data")
    want_scale = ref.scale if layout == "compact" else reference.swizzle_scales(ref.scale, fmt, axis)
    assert_leaf_bits(q.scale, want_scale, f"{what} scale")
    for name in ("amax", "window_amax"):
        a, b = getattr(q, name), getattr(ref, name)
        assert (a is None) == (b is None), (name, what)
        if a is not None:
            assert_leaf_bits(a, b, f"{what} {name}")


@functools.partial(jax.jit, static_argnames=("fmt", "axis"))
def _jref(x, fmt, axis, key):
    return reference.quantize(x, fmt, axis=axis, key=key if needs_key(fmt) else None)


@functools.partial(jax.jit, static_argnames=("fmt", "axis"))
def _compact_and_swizzled(x, fmt, axis, key):
    key = key if needs_key(fmt) else None
    return (jax_fp4.quantize(x, fmt, axis=axis, key=key),
            jax_fp4.quantize(x, fmt, axis=axis, key=key, scale_layout="swizzled"))  # XLA CSEs the common work


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_quantize_equals_reference(rng, fmt):
    """axis -1 and 0 of a 2-D bf16 x (compact scales) and the middle axis of a rank-3 f32 x (compact and swizzled)."""
    x2 = random_input(rng, (64, 128), jnp.bfloat16)
    for axis in (-1, 0):
        _check_against_reference(jq(x2, fmt, axis, KEY), _jref(x2, fmt, axis, KEY), fmt, axis - (axis >= 0) * 2,
                                 "compact", f"{fmt!r} bf16[64, 128] axis={axis}")
    x3 = random_input(rng, (2, 64, 32), jnp.float32)
    ref = _jref(x3, fmt, 1, KEY)
    for q, layout in zip(_compact_and_swizzled(x3, fmt, 1, KEY), ("compact", "swizzled"), strict=True):
        _check_against_reference(q, ref, fmt, -2, layout, f"{fmt!r} f32[2, 64, 32] axis=1 {layout}")


@pytest.mark.parametrize("fmt", [MXFP8()], ids=fmt_id)  # NVFP4 empties: tests/test_quantize_kernels.py (GPU vs CPU)
def test_empty_inputs(fmt):
    """Empty x (one zero-length axis), both orientations, compact and swizzled scales (swizzled [0, n] scale matrices
    pad to [0, 4], [n, 0] ones to [128, 0])."""
    cases = [(shape, axis) for shape in ((64, 0), (0, 64)) for axis in (-1, 0)]

    @jax.jit
    def f(xs):
        return [(jax_fp4.quantize(x, fmt, axis=a), jax_fp4.quantize(x, fmt, axis=a, scale_layout="swizzled"),
                 reference.quantize(x, fmt, axis=a)) for x, (_, a) in zip(xs, cases, strict=True)]

    out = f([jnp.zeros(shape, jnp.bfloat16) for shape, _ in cases])
    for (shape, axis), (qc, qs, ref) in zip(cases, out, strict=True):
        what = f"{fmt!r} bf16{list(shape)} axis={axis}"
        _check_against_reference(qc, ref, fmt, axis - (axis >= 0) * 2, "compact", what)
        _check_against_reference(qs, ref, fmt, axis - (axis >= 0) * 2, "swizzled", what)


# ---- dbias -----------------------------------------------------------------------------------------------------------
DBIAS_CASES = [
    (MXFP8(), None, (100, 64), jnp.bfloat16),  # M = 100: not a multiple of the 64-row stripes
    (MXFP8(), None, (100, 64), jnp.float32),
    (MXFP8(), None, (3, 50, 96), jnp.float32),  # M = 150 over a rank-3 x
    (NVFP4(), MXFP8(), (224, 64), jnp.bfloat16),  # M = 224 = 3.5 stripes, both orientations
]


@pytest.mark.parametrize(
    "row_fmt,col_fmt,shape,dtype", DBIAS_CASES,
    ids=[f"{c[0]!r}-{c[1]!r}-{c[2]}-{dtype_id(c[3])}" for c in DBIAS_CASES],
)
def test_dbias_within_fp32_summation_bound(rng, row_fmt, col_fmt, shape, dtype):
    # |dbias - sum| <= (M-1) * 2**-24 * sum|x| per column (to first order; exactly gamma_{M-1} = (M-1)u / (1-(M-1)u)):
    # the fp32 summation error bound of any order of M-1 additions, see assert_dbias_close.
    x = (rng.standard_normal(shape) * 4.0 + 1.0).astype(dtype)  # a non-zero mean: cancellation-free sums
    row, col, db = jquantize_rc(x, row_fmt, col_fmt, dbias=True)
    assert db.dtype == jnp.float32 and db.shape == (shape[-1],)
    assert_dbias_close(db, np.asarray(x, np.float32).reshape(-1, shape[-1]))
    if col_fmt is None:  # the quantizations are unaffected by dbias=True
        assert_same_bits(row, jq(x, row_fmt), "row with dbias=True vs quantize")


# ---- vmap / scan / jit -----------------------------------------------------------------------------------------------
SR = NVFP4(stochastic_rounding=True)
VMAP_CASES = [  # (format, axis, scale layout, key mode)
    (NVFP4(), -1, "compact", None),
    (MXFP8(), 0, "compact", None),
    (SR, -1, "compact", "batched"),
    (SR, -1, "compact", "shared"),
    (MXFP8(), -1, "swizzled", None),
]

VMAP_PARAMS = [pytest.param(*c, id=f"{c[0]!r}-{c[1]}-{c[2]}-{c[3]}", marks=vmap_marks(c[3], c[2]))
               for c in VMAP_CASES]


@pytest.mark.parametrize("fmt,axis,layout,keys", VMAP_PARAMS)
def test_vmap_equals_per_example(rng, fmt, axis, layout, keys):
    B = 3
    xb = random_input(rng, (B, 64, 128), jnp.bfloat16)
    ks = jax.random.split(KEY, B)
    if keys == "batched":
        got = jax.jit(jax.vmap(lambda x, k: jax_fp4.quantize(x, fmt, axis=axis, key=k, scale_layout=layout),
                               in_axes=(0, 0)))(xb, ks)
        want = [jq(xb[i], fmt, axis, ks[i], layout) for i in range(B)]
    else:
        key = KEY if keys == "shared" else None
        got = jax.jit(jax.vmap(lambda x: jax_fp4.quantize(x, fmt, axis=axis, key=key, scale_layout=layout)))(xb)
        want = [jq(xb[i], fmt, axis, key, layout) for i in range(B)]
    want = jax.tree.map(lambda *a: jnp.stack(a), *want)  # per-example amax stacked to [B]
    assert_same_bits(got, want, f"vmap {fmt!r}")


def test_scan_equals_per_slice_and_jit_equals_eager(rng):
    fmt_a, fmt_b = NVFP4(), MXFP8()
    xs = random_input(rng, (3, 64, 128), jnp.bfloat16)

    def body(c, x):
        return c, (jax_fp4.quantize(x, fmt_a), jax_fp4.quantize(x, fmt_b, axis=0, scale_layout="swizzled"))

    _, got = jax.jit(lambda xs: jax.lax.scan(body, None, xs))(xs)
    for i in range(xs.shape[0]):
        want = (jq(xs[i], fmt_a), jq(xs[i], fmt_b, 0, scale_layout="swizzled"))
        assert_same_bits(jax.tree.map(lambda a, i=i: a[i], got), want, f"scan slice {i}")
    # eager (op by op; the primitive compiled alone by its impl rule) == jit
    assert_same_bits(jax_fp4.quantize(xs[0], fmt_a), jq(xs[0], fmt_a), "eager vs jit")


# ---- eval_shape: the documented shapes and dtypes --------------------------------------------------------------------
E4M3, E5M2, E8M0, F4, F32, U8 = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu, jnp.float4_e2m1fn,
                                 jnp.float32, jnp.uint8)
ABSENT = [((0,), U8), ((0,), U8), ((0,), F32)]
# x3 [P=2, M=96, K=128] (1x64: M=64): row_data, row_scale, row_wamax, col_data, col_scale, col_wamax (module docstring
# of jax_fp4/_src/primitives/quantize.py; swizzled: the [P*rows, n/bs] scale matrix padded to (128, 4) multiples).
ORIENTATION_SHAPES = {
    ("nv", "row", "compact"): [((2, 96, 128), F4), ((2, 96, 8), E4M3), ((0,), F32)],
    ("nv", "col", "compact"): [((2, 128, 96), F4), ((2, 128, 6), E4M3), ((0,), F32)],
    ("nv", "row", "swizzled"): [((2, 96, 128), F4), ((256, 8), E4M3), ((0,), F32)],
    ("nv", "col", "swizzled"): [((2, 128, 96), F4), ((256, 8), E4M3), ((0,), F32)],
    ("mx", "row", "compact"): [((2, 96, 128), E4M3), ((2, 96, 4), E8M0), ((0,), F32)],
    ("mx", "col", "compact"): [((2, 96, 128), E5M2), ((2, 3, 128), E8M0), ((0,), F32)],
    ("mx", "row", "swizzled"): [((2, 96, 128), E4M3), ((256, 4), E8M0), ((0,), F32)],
    ("mx", "col", "swizzled"): [((2, 96, 128), E5M2), ((256, 4), E8M0), ((0,), F32)],
    ("1x64", "row", "compact"): [((2, 64, 128), F4), ((2, 64, 8), E4M3), ((2, 64, 2), F32)],
    ("1x64", "col", "compact"): [((2, 128, 64), F4), ((2, 128, 4), E4M3), ((2, 128, 1), F32)],
    ("1x64", "row", "swizzled"): [((2, 64, 128), F4), ((128, 8), E4M3), ((2, 64, 2), F32)],
    ("1x64", "col", "swizzled"): [((2, 128, 64), F4), ((256, 4), E4M3), ((2, 128, 1), F32)],
}
SPEC = {"nv": NVFP4(), "mx": MXFP8(), "1x64": NVFP4(local_1x64=True)}
COL_SPEC = {**SPEC, "mx": MXFP8(element="e5m2")}
EVAL_CASES = [(r, c, lay, lay == "compact") for r, c in [("nv", "nv"), ("mx", "mx"), ("nv", "mx"), (None, "nv"),
                                                         ("mx", None), ("1x64", "1x64")]
              for lay in ("compact", "swizzled")]


@pytest.mark.parametrize("row,col,layout,dbias", EVAL_CASES, ids=lambda v: str(v))
def test_quantize_3d_eval_shape(row, col, layout, dbias):
    m = 64 if "1x64" in (row, col) else 96
    x3 = jax.ShapeDtypeStruct((2, m, 128), jnp.bfloat16)
    a, k = jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32)
    row_fmt, col_fmt = SPEC.get(row), COL_SPEC.get(col)
    out = jax.eval_shape(functools.partial(quantize_3d, row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=layout,
                                           dbias=dbias), x3, a, a, k, k)
    assert sorted(out) == sorted(OUTPUT_NAMES)
    want = (ORIENTATION_SHAPES[(row, "row", layout)] if row else ABSENT)
    want = want + (ORIENTATION_SHAPES[(col, "col", layout)] if col else ABSENT)
    want = want + [((2, -(-m // 64), 128), F32) if dbias else ((0,), F32)]
    for name, (shape, dtype) in zip(OUTPUT_NAMES, want, strict=True):
        got = out[name]
        assert (got.shape, got.dtype) == (shape, jnp.dtype(dtype)), (name, got, shape, dtype)


def _sd(a):
    return None if a is None else (a.shape, a.dtype)


# (format, x shape, axis, layout) -> (data, scale, amax, window_amax) as (shape, dtype) or None
QA_CASES = [
    (NVFP4(), (4, 96, 128), 1, "compact", (((4, 128, 96), F4), ((4, 128, 6), E4M3), ((), F32), None)),
    (NVFP4(rht=True), (4, 96, 128), -1, "swizzled", (((4, 96, 128), F4), ((384, 8), E4M3), ((), F32), None)),
    (NVFP4(local_1x64=True), (4, 64, 128), 1, "compact",
     (((4, 128, 64), F4), ((4, 128, 4), E4M3), None, ((4, 128, 1), F32))),
    (MXFP8(), (4, 96, 128), 1, "compact", (((4, 96, 128), E4M3), ((4, 3, 128), E8M0), None, None)),
    (MXFP8(element="e5m2"), (96, 128), 0, "swizzled", (((96, 128), E5M2), ((128, 4), E8M0), None, None)),
    (NVFP4(scaling_2d=True), (0, 64), -1, "compact", (((0, 64), F4), ((0, 4), E4M3), ((), F32), None)),
]


@pytest.mark.parametrize("fmt,shape,axis,layout,want", QA_CASES, ids=[f"{c[0]!r}-{c[1]}-{c[2]}" for c in QA_CASES])
def test_quantize_eval_shape(fmt, shape, axis, layout, want):
    q = jax.eval_shape(lambda x: jax_fp4.quantize(x, fmt, axis=axis, key=KEY, scale_layout=layout),
                       jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    got = tuple(_sd(getattr(q, n)) for n in ("data", "scale", "amax", "window_amax"))
    assert got == tuple(None if w is None else (w[0], jnp.dtype(w[1])) for w in want)
    assert q.shape == shape and q.axis == (axis - len(shape) if axis >= 0 else axis)


def test_rowwise_columnwise_eval_shape():
    x = jax.ShapeDtypeStruct((2, 48, 128), jnp.float32)  # viewed as [96, 128]
    row, col, db = jax.eval_shape(lambda x: jax_fp4.quantize_rowwise_columnwise(x, NVFP4(), MXFP8(), dbias=True), x)
    assert _sd(row.data) == ((2, 48, 128), F4) and _sd(row.scale) == ((2, 48, 8), E4M3) and _sd(row.amax) == ((), F32)
    assert _sd(col.data) == ((96, 128), E4M3) and _sd(col.scale) == ((3, 128), E8M0) and col.amax is None
    assert _sd(db) == ((128,), F32)
    row, col, db = jax.eval_shape(lambda x: jax_fp4.quantize_rowwise_columnwise(x, None, NVFP4()), x)
    assert row is None and db is None and _sd(col.data) == ((128, 96), F4) and _sd(col.scale) == ((128, 6), E4M3)


# ---- errors ----------------------------------------------------------------------------------------------------------
def _raises(fn, shape, dtype=jnp.bfloat16, *words):
    """fn raises ValueError at trace time (under eval_shape: nothing is compiled or run) naming the shape."""
    with pytest.raises(ValueError) as info:
        jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, dtype))
    msg = str(info.value)
    dims = ", ".join(map(str, shape))
    assert f"({dims})" in msg or f"[{dims}]" in msg or f"({dims},)" in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_bad_scale_layout():
    for fmt in (NVFP4(), MXFP8()):
        _raises(lambda x, fmt=fmt: jax_fp4.quantize(x, fmt, scale_layout="tiled"), (64, 128), jnp.bfloat16,
                repr(fmt), "tiled")
    _raises(lambda x: jax_fp4.quantize_rowwise_columnwise(x, None, MXFP8(), scale_layout="padded"), (64, 128),
            jnp.float32, "MXFP8()", "padded")


def test_bad_inputs_rowwise_columnwise():
    qrc = jax_fp4.quantize_rowwise_columnwise
    _raises(lambda x: qrc(x, None, None), (64, 128))
    _raises(lambda x: qrc(x, NVFP4(), MXFP8()), (128,), jnp.bfloat16, "rank")
    _raises(lambda x: qrc(x, NVFP4(), None), (64, 40), jnp.bfloat16, "NVFP4()", "40")  # rowwise K % 16
    _raises(lambda x: jax_fp4.quantize(x, NVFP4()), (64, 40), jnp.bfloat16, "NVFP4()", "40")
    _raises(lambda x: qrc(x, None, MXFP8()), (48, 64), jnp.bfloat16, "MXFP8()", "48")  # columnwise M % 32
    with pytest.raises(ValueError, match=re.escape("(48, 64)")):  # M = 48 of a rank-3 x: names x.reshape(M, K)
        jax.eval_shape(lambda x: qrc(x, NVFP4(), MXFP8()), jax.ShapeDtypeStruct((3, 16, 64), jnp.bfloat16))
    _raises(lambda x: jax_fp4.quantize(x, MXFP8(), axis=0), (48, 64), jnp.bfloat16, "MXFP8()", "48")
    sr = NVFP4(stochastic_rounding=True)
    _raises(lambda x: jax_fp4.quantize(x, sr), (64, 128), jnp.float32, "key")
    _raises(lambda x: qrc(x, NVFP4(), sr), (64, 128), jnp.float32, "key")
    _raises(lambda x: qrc(x, sr, None, key=None), (64, 128), jnp.float32, "key")


def test_bad_inputs_jit_raises_at_trace_time():
    with pytest.raises(ValueError, match=re.escape("(64, 40)")):
        jax.jit(lambda x: jax_fp4.quantize_rowwise_columnwise(x, NVFP4(), None)).trace(jnp.zeros((64, 40)))


def test_quantize_3d_rejects_bad_operands():
    x = jax.ShapeDtypeStruct((2, 32, 64), jnp.bfloat16)
    f32_2, u32_2 = jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32)
    bad = {
        "amax_row": jax.ShapeDtypeStruct((1,), jnp.float32),
        "amax_col": jax.ShapeDtypeStruct((2,), jnp.float16),
        "key_row": jax.ShapeDtypeStruct((3,), jnp.uint32),
        "key_col": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    for name, b in bad.items():
        args = {"amax_row": f32_2, "amax_col": f32_2, "key_row": u32_2, "key_col": u32_2, name: b}
        f = functools.partial(quantize_3d, row_fmt=NVFP4(), col_fmt=MXFP8())
        with pytest.raises(ValueError, match=re.escape(f"{name} must be")) as info:
            jax.eval_shape(f, x, *args.values())
        assert f"{jnp.dtype(b.dtype)}{list(b.shape)}" in str(info.value), str(info.value)
    f = functools.partial(quantize_3d, row_fmt=NVFP4(), col_fmt=None)
    with pytest.raises(ValueError, match=re.escape("[32, 64]")):  # rank 2: not [P, M, K]
        jax.eval_shape(f, jax.ShapeDtypeStruct((32, 64), jnp.bfloat16), f32_2, f32_2, u32_2, u32_2)
    with pytest.raises(ValueError, match="no rowwise or columnwise"):
        jax.eval_shape(functools.partial(quantize_3d, row_fmt=None, col_fmt=None), x, f32_2, f32_2, u32_2, u32_2)
    with pytest.raises(ValueError, match="scale_layout"):
        jax.eval_shape(functools.partial(quantize_3d, row_fmt=NVFP4(), col_fmt=None, scale_layout="x"), x,
                       f32_2, f32_2, u32_2, u32_2)


# ---- rht_amax --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=dtype_id)
def test_rht_amax_equals_reference(rng, dtype):
    x3 = random_input(rng, (3, 32, 64), dtype)
    x3[1] = random_input(rng, (32, 64), dtype, scale_exp=-120)  # tiny: flushed in the RHT
    x3[2, :, :16] = np.nan

    @jax.jit
    def f(x3):
        got = (rht_amax(x3, "row"), rht_amax(x3, "col"))
        want = (jnp.stack([reference.amax(reference.rht.forward(x3[p])) for p in range(x3.shape[0])]),
                jnp.stack([reference.amax(reference.rht.forward(x3[p].T)) for p in range(x3.shape[0])]))
        return got, want

    got, want = f(x3)
    assert got[0].shape == (3,) and got[0].dtype == jnp.float32
    assert_same_bits(got, want, "rht_amax (row, col)")
    with pytest.raises(ValueError, match="not % 16"):
        jax.eval_shape(lambda x: rht_amax(x, "col"), jax.ShapeDtypeStruct((1, 24, 64), dtype))
    with pytest.raises(ValueError, match="orientation"):
        jax.eval_shape(lambda x: rht_amax(x, "diag"), jax.ShapeDtypeStruct((1, 32, 64), dtype))
