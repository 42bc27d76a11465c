"""Structural properties of the reference: re-quantization fixed points, 2D transposes, scale layouts, shapes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4.reference import layout

from ._util import bits, codes_of, dequantize, quantize

NV, NV2D, NV64 = jax_fp4.NVFP4(), jax_fp4.NVFP4(scaling_2d=True), jax_fp4.NVFP4(local_1x64=True)
MX4, MX5 = jax_fp4.MXFP8(), jax_fp4.MXFP8(element="e5m2")


def _data(rng, shape, row_spread=2.0, lo=-20):
    """Gaussian data, one global magnitude 10**U(lo, 20), each row scaled by 10**U(0, row_spread).

    The bounded spread keeps every NVFP4 block scale an E4M3 *normal* (block amax / tensor amax >~ 1e-3, so
    s_b = 448 * block_amax / amax >~ 0.4 >> 2**-6): see test_nvfp4_subnormal_block_scale_is_not_a_fixed_point.
    1x64 needs lo >~ -10 too: a window amax A_w below the 1e-12 floor gets S_enc,w = 2688/1e-12 and block scales
    448 * a_b / 1e-12, which are E4M3 subnormals once A_w <~ 1e-16 (the same exception).
    """
    g = 10.0 ** rng.uniform(lo, 20)
    rows = 10.0 ** rng.uniform(0, row_spread, (shape[0],) + (1,) * (len(shape) - 1))
    return (rng.standard_normal(shape) * rows * g).astype(np.float32)


def _ulps(a, b):
    return abs(int(bits(a)) - int(bits(b)))


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", [NV, NV2D, NV64], ids=repr)
def test_nvfp4_requantize_is_a_fixed_point(rng, fmt, axis):
    """quantize(dequantize(q)) == q for data and scale codes (NVFP4 1D, 2D and 1x64).

    Why: with a normal E4M3 s_b (3 mantissa bits, relative rounding <= 2**-4) the block's largest scaled value lies
    in [6/(1+2**-4), 6/(1-2**-4)] = [5.65, 6.4] and rounds to 6; dequantized, it is 6 * s_b * S_dec (+ fp32
    rounding), whose re-derived scale is s_b again, and every value(q) * f * e_b' is value(q) up to a few fp32 ulps,
    far from any E2M1 midpoint. The tensor amax is *not* bit-identical: the new amax is fl(6 * fl(fl(448 * A) *
    fp32(1/2688))), three roundings plus fp32(1/2688)'s own 0.3-ulp error -> at most 3 ulps from A (1x64: the
    window amax fl(fl(6 * 448) / fl(2688 / A_w)), at most 2 ulps).
    RHT and SR are excluded by design: RHT re-applies H to Hᵀ-transformed values and re-rounds them to bf16, and
    SR rounds a value a few ulps below a grid point (dequantization is not exact) down to the previous grid point
    with probability ~1 - 1/256: neither is meant to be idempotent.
    """
    x = _data(rng, (64, 128), lo=-10 if fmt.local_1x64 else -20)
    q = quantize(jnp.asarray(x), fmt, axis=axis)
    q2 = quantize(dequantize(q), fmt, axis=axis)
    np.testing.assert_array_equal(codes_of(q2.data), codes_of(q.data))
    np.testing.assert_array_equal(codes_of(q2.scale), codes_of(q.scale))
    if fmt.local_1x64:
        w, w2 = np.asarray(q.window_amax).ravel(), np.asarray(q2.window_amax).ravel()
        assert max(_ulps(a, b) for a, b in zip(w, w2, strict=True)) <= 2
    else:
        assert _ulps(q.amax, q2.amax) <= 3


def test_nvfp4_subnormal_block_scale_is_not_a_fixed_point():
    """The exception, by hand. amax 2688 -> S_enc = 1. Block 1 amax 0.01875: s_b = e4m3(0.01875 * fp32(1/6) =
    1.6 * 2**-9) -> subnormal 2 * 2**-9 (0x02), e_b = 2**8, 0.01875 * 256 = 4.8 < 5 -> 4 (0x6): the block max is
    not 6. Dequantized: 4 * 2**-8 = 2**-6; re-quantized: s_b = e4m3(2**-6 / 6 = 1.33 * 2**-9) = 2**-9 (0x01),
    2**-6 * 2**9 = 8 -> 6 (0x7). A subnormal E4M3 scale's rounding error (up to 1/3 here) breaks idempotence."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 16] = 2688, 0.01875
    q = quantize(jnp.asarray(x), NV)
    q2 = quantize(dequantize(q), NV)
    assert codes_of(q.scale)[0, 1] == 0x02 and codes_of(q.data)[0, 16] == 0x6
    assert codes_of(q2.scale)[0, 1] == 0x01 and codes_of(q2.data)[0, 16] == 0x7


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("fmt", [MX4, MX5], ids=repr)
def test_mxfp8_requantize_is_a_fixed_point_except_half_max_blocks(rng, fmt, axis):
    """quantize(dequantize(q)) == q, except blocks whose largest |value(q)| is exactly max_norm/2 (224 / 28672).

    Why the exception (spec-inherent): fp32(1/448) = 1/448 + 1e-10 makes 448 * fp32(1/448) round to exactly 1.0.
    A block with amax a slightly above 448 * 2**k (a in (448, 464) * 2**k) gets v = a * fp32(1/448) > 2**k ->
    e = 127 + k + 1 and its largest value a * 2**-(k+1) in (224, 232) rounds to 224. Dequantized, that block's amax
    is 224 * 2**(k+1) = 448 * 2**k exactly, v = 2**k exactly, so e drops by one and every value doubles (exact in
    E4M3/E5M2). The dequantized values are the same either way, which the test also checks for every block.
    (Same for fp32(1/57344) = fp32(1/448) * 2**-7.)
    """
    # Magnitudes 1e-20 .. 1e35: well inside fp32 (a block amax within 2**-5 of FLT_MAX would round to 256 * 2**120
    # = inf when dequantized; see test_edge_table_mxfp8).
    x = _data(rng, (128, 256), row_spread=15.0)
    q = quantize(jnp.asarray(x), fmt, axis=axis)
    xh = dequantize(q)
    q2 = quantize(xh, fmt, axis=axis)
    np.testing.assert_array_equal(np.asarray(dequantize(q2)), np.asarray(xh))
    # Per-block view (block axis last, blocks of 32): [rows, nblocks, 32].
    to_blocks = lambda a: np.moveaxis(np.asarray(a), axis, -1).reshape(-1, a.shape[axis] // 32, 32)  # noqa: E731
    s, s2 = (np.moveaxis(codes_of(t.scale), axis, -1).reshape(-1, x.shape[axis] // 32) for t in (q, q2))
    vmax = np.abs(to_blocks(q.data.astype(jnp.float32))).max(-1)
    special = vmax == fmt.max_value / 2
    same = ~special
    np.testing.assert_array_equal(s2[same], s[same])
    np.testing.assert_array_equal(to_blocks(codes_of(q2.data))[same], to_blocks(codes_of(q.data))[same])
    np.testing.assert_array_equal(s2[special].astype(int), s[special].astype(int) - 1)
    assert special.any() and same.any()  # with ~250 blocks both kinds occur (about 5% of blocks are special)


def test_nvfp4_2d_rowwise_and_columnwise_are_transposes(rng):
    x = _data(rng, (48, 64))
    r = quantize(jnp.asarray(x), NV2D, axis=-1)
    c = quantize(jnp.asarray(x), NV2D, axis=0)
    assert r.data.shape == (48, 64) and c.data.shape == (64, 48)
    np.testing.assert_array_equal(codes_of(c.data), codes_of(r.data).T)
    per_elem_r = np.repeat(codes_of(r.scale), 16, axis=1)  # [48, 64]: s_b of every element
    per_elem_c = np.repeat(codes_of(c.scale), 16, axis=1)  # [64, 48]
    np.testing.assert_array_equal(per_elem_c, per_elem_r.T)
    assert float(r.amax) == float(c.amax)
    # One scale per 16x16 tile: rows of a tile carry the same scales, tiles differ.
    tiles = codes_of(r.scale).reshape(3, 16, 4)
    assert (tiles == tiles[:, :1]).all() and len(np.unique(tiles)) > 1
    np.testing.assert_array_equal(np.asarray(dequantize(c)), np.asarray(dequantize(r)))


def _swizzle_loops(s):
    """docs/numerics.md s3 written out: pad to [round_up(R,128), round_up(C,4)] with zeros, then flat index of S[i, j]
    = ((i//128)*(C/4) + j//4)*512 + (i%32)*16 + ((i%128)//32)*4 + j%4."""
    r, c = s.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    flat = np.zeros(rp * cp, s.dtype)
    for i in range(rp):
        for j in range(cp):
            k = ((i // 128) * (cp // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
            flat[k] = s[i, j] if (i < r and j < c) else 0
    return flat.reshape(rp, cp)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (127, 4), (130, 7), (257, 9), (128, 8)])
def test_swizzle_against_the_flat_index_formula(rng, shape):
    s = rng.integers(0, 256, shape, dtype=np.uint8)
    sw = np.asarray(layout.swizzle(jnp.asarray(s)))
    np.testing.assert_array_equal(sw, _swizzle_loops(s))
    np.testing.assert_array_equal(np.asarray(layout.unswizzle(jnp.asarray(sw), *shape)), s)
    # Typed 8-bit scales go through the same byte layout.
    e8 = jnp.asarray(s.view(jnp.float8_e8m0fnu))
    np.testing.assert_array_equal(codes_of(layout.swizzle(e8)), sw)


@pytest.mark.parametrize("fmt,shape,axis", [(NV, (3, 40, 32), -1), (NV, (48, 20), 0), (MX4, (64, 5, 32), 0),
                                            (MX4, (7, 96), -1), (MX5, (3, 64, 32), 1)], ids=str)
def test_swizzle_scales_round_trip_and_dequantize(rng, fmt, shape, axis):
    x = jnp.asarray(_data(rng, shape))
    q = quantize(x, fmt, axis=axis)
    s = quantize(x, fmt, axis=axis, scale_layout="swizzled")
    assert s.scale_layout == "swizzled"
    np.testing.assert_array_equal(codes_of(jax_fp4.swizzle_scales(q).scale), codes_of(s.scale))
    np.testing.assert_array_equal(codes_of(jax_fp4.unswizzle_scales(s).scale), codes_of(q.scale))
    np.testing.assert_array_equal(np.asarray(dequantize(s)), np.asarray(dequantize(q)))


def _round_up(n, m):
    return -(-n // m) * m


EVAL_FORMATS = [NV, NV2D, jax_fp4.NVFP4(rht=True), jax_fp4.NVFP4(stochastic_rounding=True), NV64, MX4, MX5]


@pytest.mark.parametrize("layout_", ["compact", "swizzled"])
@pytest.mark.parametrize("shape,axis", [((64, 128), -1), ((64, 128), 0), ((2, 64, 192), -1), ((2, 64, 192), 1),
                                        ((128, 64, 64), 0), ((320,), 0)])
@pytest.mark.parametrize("fmt", EVAL_FORMATS, ids=repr)
def test_shapes_and_dtypes_under_eval_shape(fmt, shape, axis, layout_):
    if isinstance(fmt, jax_fp4.NVFP4) and (fmt.scaling_2d or fmt.local_1x64) and len(shape) == 1:
        pytest.skip("2D / 1x64 need a non-block axis")
    key = jax.random.key(0)
    q = jax.eval_shape(lambda x, k: jax_fp4.quantize(x, fmt, axis=axis, key=k, scale_layout=layout_),
                       jax.ShapeDtypeStruct(shape, jnp.bfloat16), key)
    nd = len(shape)
    ax = axis % nd
    if isinstance(fmt, jax_fp4.NVFP4):
        data = tuple(d for i, d in enumerate(shape) if i != ax) + (shape[ax],)  # block axis moved last
        scale = data[:-1] + (data[-1] // 16,)
        assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn
        if fmt.local_1x64:
            assert q.amax is None
            assert q.window_amax.shape == data[:-1] + (data[-1] // 64,) and q.window_amax.dtype == jnp.float32
        else:
            assert q.amax.shape == () and q.amax.dtype == jnp.float32 and q.window_amax is None
        rows, cols = math.prod(scale[:-1]), scale[-1]
    else:
        data = shape
        scale = tuple(d // 32 if i == ax else d for i, d in enumerate(shape))
        assert q.data.dtype == fmt.data_dtype and q.scale.dtype == jnp.float8_e8m0fnu
        assert q.amax is None and q.window_amax is None
        rows, cols = math.prod(d for i, d in enumerate(scale) if i != ax), scale[ax]  # e.g. [M/32, K] -> [K, M/32]
    assert q.data.shape == data
    if layout_ == "compact":
        assert q.scale.shape == scale
    else:
        assert q.scale.shape == (_round_up(rows, 128), _round_up(cols, 4))
    assert q.shape == shape and q.axis == axis % nd - nd and q.scale_layout == layout_ and q.fmt == fmt


def test_mxfp8_columnwise_swizzle_transposes_first(rng):
    """MXFP8 columnwise scales [M/32, K] are viewed as [K, M/32] before padding/swizzling (docs/numerics.md s3)."""
    x = jnp.asarray(_data(rng, (64, 8)))
    q = quantize(x, MX4, axis=0)
    comp = codes_of(q.scale)  # [2, 8]
    sw = codes_of(quantize(x, MX4, axis=0, scale_layout="swizzled").scale)
    np.testing.assert_array_equal(sw, _swizzle_loops(comp.T))
