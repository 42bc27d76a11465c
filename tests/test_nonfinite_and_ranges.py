"""NaN / Inf stay visible through quantized operands, and NVFP4 decodes consistently at extreme tensor ranges (CPU).

* a NaN in an NVFP4 operand: the codes and block scales are those of the finite amax (the encode ignores the NaN as
  TE's does), the carried amax is NaN, so dequantize, scaled_dot_general, dense and fake_quantize give NaN (bf16 and
  MXFP8 show a NaN too); an Inf gives an inf amax and a non-finite output;
* tensors with amax below fp32(2688 / FLT_MAX) = 7.9e-36 (the encode scale is clamped at FLT_MAX) and above
  FLT_MAX / 448 = 7.6e35 (s_b * amax overflows) dequantize within the format's error of x, like any other tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, recipes
from jax_fp4.reference import nvfp4 as ref_nvfp4

X = np.array(jax.random.normal(jax.random.key(0), (32, 64), jnp.float32))
W = np.array(jax.random.normal(jax.random.key(1), (64, 32), jnp.float32))


def _bits(a):
    return np.asarray(jax_fp4.reference.codes.from_dtype(a)) if jnp.dtype(a.dtype).itemsize == 1 else \
        np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True)], ids=repr)
def test_nan_reaches_the_decode_codes_unchanged(fmt):
    x = X.copy()
    x[3, 7] = np.nan
    q = jax_fp4.quantize(jnp.asarray(x), fmt)
    assert np.isnan(float(q.amax)) and np.isnan(np.asarray(jax_fp4.dequantize(q))).all()
    # the codes and block scales are the encode of the finite amax (TE's: NaN ignored, NaN -> +6)
    ref = jax_fp4.reference.quantize(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(_bits(q.data), _bits(ref.data))
    np.testing.assert_array_equal(_bits(q.scale), _bits(ref.scale))
    finite = jax_fp4.reference.amax(jnp.asarray(x))
    assert not np.isnan(float(finite))
    if not fmt.rht:
        want_codes = ref_nvfp4.quantize_with_amax(jnp.asarray(x), fmt, finite).codes
        np.testing.assert_array_equal(np.asarray(jax_fp4.reference.codes.from_dtype(q.data)), np.asarray(want_codes))
    assert np.isnan(float(ref.amax))  # the reference carries it too


@pytest.mark.parametrize("recipe", [recipes.NVFP4(), recipes.NVFP4Fwd_MXFP8Bwd(), recipes.MXFP8(), recipes.BF16()],
                         ids=lambda r: r.name)
@pytest.mark.parametrize("where", ["x", "w"])
def test_nan_reaches_the_gemm_output(recipe, where):
    x, w = X.copy(), W.copy()
    (x if where == "x" else w)[5, 9] = np.nan
    y = np.asarray(jax.jit(lambda x, w: jax_fp4.dense(x, w, recipe=recipe))(jnp.asarray(x), jnp.asarray(w)))
    assert np.isnan(y).any()
    assert np.isnan(y[5]).all() if where == "x" else np.isnan(y[:, 9]).all()  # at least where bf16 has NaN
    # quantize_rowwise_columnwise's exact operands (the emulated GEMM's) carry it too
    if isinstance(recipe.fprop_x, NVFP4):
        row, col, _ = jax_fp4.quantize_rowwise_columnwise(jnp.asarray(x), NVFP4(), NVFP4(), exact=(True, True))
        if where == "x":
            assert np.isnan(float(row.tensor_scale)) and np.isnan(float(col.tensor_scale))


def test_nan_and_inf_through_scaled_dot_general_and_fake_quantize():
    x = X.copy()
    x[0, 0] = np.nan
    a = jax_fp4.quantize(jnp.asarray(x), NVFP4())
    b = jax_fp4.quantize(jnp.asarray(W), NVFP4(), axis=0)
    assert np.isnan(np.asarray(jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ()))))).any()
    assert np.isnan(np.asarray(jax_fp4.fake_quantize(jnp.asarray(x), NVFP4()))).any()
    x[0, 0] = np.inf
    q = jax_fp4.quantize(jnp.asarray(x), NVFP4())
    assert np.isposinf(float(q.amax)) and not np.isfinite(np.asarray(jax_fp4.dequantize(q))).all()
    y = jax_fp4.dense(jnp.asarray(x), jnp.asarray(W), recipe=recipes.NVFP4())
    assert not np.isfinite(np.asarray(y)).all()


def _roundtrip_error(x, fmt):
    """max |dequantize(quantize(x)) - x| / max|x| per 16-block row (float32 output)."""
    q = jax_fp4.quantize(jnp.asarray(x), fmt)
    xh = np.asarray(jax_fp4.dequantize(q, jnp.float32), np.float64)
    xb = np.asarray(x, np.float64).reshape(x.shape[0], -1, 16)
    err = np.abs(xh.reshape(xb.shape) - xb).max(-1)
    return (err / np.abs(xb).max(-1)).max(), q


@pytest.mark.parametrize("scale", [1e-37, 3e-36, 1.0, 1e36, 3e38], ids=lambda s: f"{s:g}")
@pytest.mark.parametrize("fmt", [NVFP4(), NVFP4(scaling_2d=True)], ids=repr)
def test_extreme_amax_dequantizes_near_x(scale, fmt):
    """Every 16-block holds a +-amax element, so every block scale is ~448 (below 7.9e-36 S_enc is FLT_MAX and a block
    scale under 1 would clamp e_b at FLT_MAX as well: a spec-inherent limit not covered here). The E2M1 error with an
    E4M3 block scale is below 1/6 of the block amax (half the largest E2M1 step, 2 / 2 / 6, times 1 + 2**-3 for the
    scale's rounding). TE's decode is x80 too small at 1e-37 and inf at 1e36."""
    u = np.array(jax.random.uniform(jax.random.key(2), (32, 64), jnp.float32, -1.0, 1.0))
    u[:, ::16] = np.where(np.arange(32)[:, None] % 2, 1.0, -1.0)
    x = (u * np.float32(scale)).astype(np.float32)
    err, q = _roundtrip_error(x, fmt)
    assert np.isfinite(err) and err < (1 / 6) * (1 + 2**-3) * (1 + 1e-6), (scale, err, float(q.amax))
    # the GEMM emulation's tensor scales: x (extreme) times u.T (amax 1), |y| <= 64 * scale. Below amax 3.2e-35 the
    # tensor scale amax / 2688 is an fp32 subnormal, which XLA's flush-to-zero multiplies as 0; above ~1e31 the fp32
    # sum of products of two 2688-scaled operands times the first tensor scale overflows (docs/numerics.md s6).
    if 3.2e-35 < scale <= 1e30:
        a = jax_fp4.quantize(jnp.asarray(x), fmt)
        b = jax_fp4.quantize(jnp.asarray(u.T.copy()), fmt, axis=0)
        y = np.asarray(jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ()))), np.float64) / np.float64(scale)
        want = np.asarray(u, np.float64) @ np.asarray(u, np.float64).T
        bound = 2 * (1 / 6) * (1 + 2**-3) * 64 * (1 + 1e-3)  # K = 64 products, each with both operands' errors
        assert np.abs(y - want).max() < bound, np.abs(y - want).max()


def test_decode_scale_rules():
    floor = np.float32(2688) / np.finfo(np.float32).max
    assert ref_nvfp4.DECODE_AMAX_FLOOR == floor
    amax = jnp.array([0.0, 1e-37, floor, 1.0, 1e36, np.inf, np.nan, 1e-40], jnp.float32)  # 1e-40: fp32 subnormal
    got = np.asarray(ref_nvfp4.decode_amax(amax))
    np.testing.assert_array_equal(got[:6], [0.0, floor, floor, 1.0, np.float32(1e36), np.inf])
    assert np.isnan(got[6]) and got[7] == floor
    # TE's association where nothing overflows, the other one where s_b * amax would
    s_b = jnp.full((3,), 448.0, jnp.float32)
    f = np.asarray(ref_nvfp4.decode_scale(s_b, jnp.array([1.0, 1e36, 3e38], jnp.float32)))
    c = np.float32(1 / 2688)
    assert f[0] == np.float32(448) * c
    assert f[1] == np.float32(448) * (np.float32(1e36) * c) and np.isfinite(f[2])


def test_mxfp8_unchanged_by_the_nvfp4_rules():
    x = X.copy()
    x[1, 2] = np.nan
    q = jax_fp4.quantize(jnp.asarray(x), MXFP8())
    assert q.amax is None
    y = np.asarray(jax_fp4.dequantize(q))
    assert np.isnan(y[1, 2]) and np.isnan(y).sum() == 1  # the NaN element's E4M3 NaN code, nothing else


def test_nan_reaches_the_grouped_gemm_output():
    """A NaN in one group's rows of x reaches that group's ragged_dot output (its NVFP4 group amax carries it); the
    other groups stay finite."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((96, 64)).astype(np.float32)
    w = rng.standard_normal((3, 64, 32)).astype(np.float32)
    sizes = jnp.asarray([32, 32, 32], jnp.int32)
    x[40, 7] = np.nan  # group 1
    y = np.asarray(jax.jit(lambda x, w: jax_fp4.ragged_dot(x, w, sizes, recipe=recipes.NVFP4()))(x, w))
    assert np.isnan(y[32:64]).all() and np.isfinite(y[:32]).all() and np.isfinite(y[64:]).all()
    gq = jax_fp4.grouped_quantize(jnp.asarray(x), sizes, NVFP4())
    ref = jax_fp4.reference.grouped.grouped_quantize(jnp.asarray(x), NVFP4(), first_dims=sizes)
    assert np.isnan(np.asarray(gq.amax)).tolist() == [False, True, False]
    np.testing.assert_array_equal(np.asarray(gq.amax).view(np.uint32), np.asarray(ref.amax).view(np.uint32))


def _mx_extremes(dtype):
    """[64, 64] of `dtype`: +-the largest finite value on one element of every row and column block, the rest N(0,1),
    and +-inf in row 1 / column 1 (whose 32-blocks get the E8M0 scale 0xFE)."""
    big = float(jnp.finfo(dtype).max)
    x = np.array(jax.random.normal(jax.random.key(4), (64, 64), jnp.float32))
    idx = np.arange(64)
    x[idx, (idx * 5) % 64] = np.where(idx % 2, big, -big)
    x[1, 40], x[40, 1] = np.inf, -np.inf
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fmt", [MXFP8(), MXFP8(element="e5m2")], ids=repr)
def test_mxfp8_largest_finite_values_decode_finite(fmt, dtype):
    """The codes are TE's (the +-max element's code rounds up past the output range: bf16 max -> E4M3 256 * 2**120
    = 2**128), and the decode saturates them to +-max of the output dtype; +-inf in x (scale 0xFE) still decodes to
    +-inf. Kernels (where built) and the reference give the same bits, rowwise and columnwise, and the bfloat16
    operands of the emulated GEMM (exact operands of the quantize pass, grouped raw values) are finite as well."""
    x = _mx_extremes(dtype)
    xf = np.asarray(x, np.float32)
    big = float(jnp.finfo(dtype).max)
    inf = np.isinf(xf)
    for axis in (-1, 0):
        q = jax_fp4.quantize(x, fmt, axis=axis)
        ref = jax_fp4.reference.quantize(x, fmt, axis=axis)
        np.testing.assert_array_equal(_bits(q.data), _bits(ref.data))  # the encoder is unchanged (TE's codes)
        for out in {jnp.dtype(dtype), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}:
            y = np.asarray(jax.jit(lambda q, o=out: jax_fp4.dequantize(q, o))(q), np.float32)
            want = jax_fp4.reference.dequantize(ref.data, ref.scale, None, None, fmt, axis, out)
            np.testing.assert_array_equal(np.asarray(want, np.float32).view(np.uint32), y.view(np.uint32))
            out_max = float(jnp.finfo(out).max)
            assert np.isfinite(y[~inf]).all() and (np.abs(y[~inf]) <= out_max).all(), (axis, out)
            np.testing.assert_array_equal(y[inf], xf[inf])  # +-inf stays +-inf
            blocks = inf.reshape(64, 2, 32).any(-1).repeat(32, 1) if axis == -1 else \
                inf.reshape(2, 32, 64).any(1).repeat(32, 0)
            at_max = (np.abs(xf) == big) & ~blocks  # (a block holding inf decodes its other values to <= 2**128)
            if out == jnp.dtype(dtype):  # round trips of +-max come back as +-max
                np.testing.assert_array_equal(y[at_max], xf[at_max])
    finite_x = jnp.where(jnp.isinf(x), 0, x).astype(x.dtype)
    row, col, _ = jax_fp4.quantize_rowwise_columnwise(finite_x, fmt, fmt, exact=(True, True))
    for e, q in ((row, jax_fp4.quantize(finite_x, fmt)), (col, jax_fp4.quantize(finite_x, fmt, axis=0))):
        assert np.isfinite(np.asarray(e.values, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(e.values, np.float32),
                                      np.asarray(jax_fp4.dequantize(q, jnp.bfloat16), np.float32))
    gq = jax_fp4.grouped_quantize(finite_x, jnp.asarray([32, 32], jnp.int32), fmt)
    g = np.asarray(jax_fp4.grouped_dequantize(gq, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(g, np.asarray(jax_fp4.dequantize(jax_fp4.quantize(finite_x, fmt), jnp.bfloat16),
                                                np.float32))
    v, _ = jax_fp4.grouped_gemm.grouped_exact_operand(gq)
    np.testing.assert_array_equal(np.asarray(v, np.float32), g)


def test_mxfp8_saturated_operand_gives_a_finite_gemm():
    """x holds bf16 max: the emulated MXFP8 GEMM against a diagonal 2**-4 w is finite (x * 2**-4 up to E4M3's
    rounding where x is +-max), where an inf operand would give inf."""
    x = _mx_extremes(jnp.bfloat16)
    x = jnp.where(jnp.isinf(x), 0, x).astype(jnp.bfloat16)
    w = jnp.eye(64, dtype=jnp.bfloat16) * jnp.bfloat16(2**-4)
    y = np.asarray(jax_fp4.dense(x, w, recipe=recipes.MXFP8()), np.float32)
    assert np.isfinite(y).all()
    a = jax_fp4.quantize(x, MXFP8())
    b = jax_fp4.quantize(w, MXFP8(), axis=0)
    y = np.asarray(jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ()))), np.float64)
    want = np.asarray(x, np.float64) * 2**-4
    at_max = np.abs(np.asarray(x, np.float32)) == float(jnp.finfo(jnp.bfloat16).max)
    assert np.isfinite(y).all() and (np.abs(y - want)[at_max] <= np.abs(want)[at_max] * 2**-3).all()


@pytest.mark.parametrize("axis", [-1, 0])
def test_nan_visible_through_1x64(axis):
    """NVFP4 1x64: the codes, scales and window amaxes are the encode's (NaN ignored), except that the window amax
    of each 1x64 window holding a NaN is NaN, so exactly that window dequantizes to NaN (kernels where built and the
    reference, same bits), and the 1x64 GEMM emulation and dense show it."""
    fmt = NVFP4(local_1x64=True)
    x = np.array(jax.random.normal(jax.random.key(5), (64, 128), jnp.float32))
    x[5, 70] = np.nan
    q = jax_fp4.quantize(jnp.asarray(x), fmt, axis=axis)
    ref = jax_fp4.reference.quantize(jnp.asarray(x), fmt, axis=axis)
    enc = ref_nvfp4.quantize_1x64(jnp.moveaxis(jnp.asarray(x), axis, -1))  # the encode itself: finite windows
    w, want_w = np.asarray(q.window_amax), np.asarray(enc.window_amax).copy()
    hit = (5, 1) if axis == -1 else (70, 0)  # stored orientation [rows, windows]
    want_w[hit] = np.nan
    np.testing.assert_array_equal(w.view(np.uint32), want_w.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(ref.window_amax).view(np.uint32), want_w.view(np.uint32))
    np.testing.assert_array_equal(_bits(q.data), np.asarray(enc.codes))
    np.testing.assert_array_equal(_bits(q.scale), np.asarray(enc.scale_codes))
    for out in (jnp.float32, jnp.bfloat16):
        y = np.asarray(jax_fp4.dequantize(q, out), np.float32)
        want = np.asarray(jax_fp4.reference.dequantize(ref.data, ref.scale, None, ref.window_amax, fmt, axis, out),
                          np.float32)
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
        nan = np.zeros(x.shape, bool)
        if axis == -1:
            nan[5, 64:128] = True
        else:
            nan[0:64, 70] = True
        np.testing.assert_array_equal(np.isnan(y), nan)
    row, col, _ = jax_fp4.quantize_rowwise_columnwise(jnp.asarray(x), fmt, fmt)
    assert np.isnan(np.asarray(row.window_amax)).sum() == 1 and np.isnan(np.asarray(col.window_amax)).sum() == 1
    b = jax_fp4.quantize(jnp.asarray(np.tile(W, (2, 2))), fmt, axis=0)  # [128, 64], blocks along K
    a = jax_fp4.quantize(jnp.asarray(x), fmt)
    y = np.asarray(jax_fp4.scaled_dot_general(a, b, (((1,), (0,)), ((), ()))))
    assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, 0)).all()
    assert np.isnan(np.asarray(jax_fp4.fake_quantize(jnp.asarray(x), fmt))[5, 64:]).all()
    xd = x[:, :64].copy()
    for where in ("x", "w"):
        xx, ww = xd.copy(), np.array(jax.random.normal(jax.random.key(6), (64, 64), jnp.float32))
        (xx if where == "x" else ww)[7, 9] = np.nan
        y = np.asarray(jax.jit(lambda a, b: jax_fp4.dense(a, b, recipe=recipes.NVFP4_1x64()))(xx, ww))
        assert np.isnan(y[7]).all() if where == "x" else np.isnan(y[:, 9]).all()
