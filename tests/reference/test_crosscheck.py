"""The reference against independent implementations: ml_dtypes / numpy for the elementary conversions and fp32
arithmetic, and jax.nn's block-scaled quantize (jax 0.10.2) where the rules agree — with the places where they
differ probed and recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4
from jax_fp4.reference import _f32
from jax_fp4.reference import mxfp8 as ref_mxfp8

from ._util import FLT_MAX, codes_of, dequantize, p2, quantize

TARGETS = {  # name: (reference target, ml_dtypes type, satfinite max or None)
    "e2m1": (_f32.E2M1, ml_dtypes.float4_e2m1fn, 6.0),
    "e4m3": (_f32.E4M3, ml_dtypes.float8_e4m3fn, 448.0),
    "e5m2": (_f32.E5M2, ml_dtypes.float8_e5m2, 57344.0),
    "bf16": (_f32.BF16, ml_dtypes.bfloat16, None),
    "f16": (_f32.F16, np.float16, None),
}
convert = jax.jit(_f32.convert, static_argnums=1)


def _values(rng, mdt):
    """Finite fp32 inputs: random bit patterns (all exponents, subnormals included), log-uniform values around
    the target's range (its subnormals included), every representable value, each midpoint between neighbours
    (an exact tie; fp32 holds it exactly) and the fp32 values one ulp either side of it."""
    raw = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw = raw[np.isfinite(raw)]
    fi = ml_dtypes.finfo(mdt)
    lo, hi = np.log2(float(fi.smallest_subnormal)) - 3, min(np.log2(float(fi.max)) + 1, 127.9)
    logu = (2.0 ** rng.uniform(lo, hi, 20000) * rng.choice([-1, 1], 20000)).astype(np.float32)
    with np.errstate(invalid="ignore"):  # the NaN codes of bf16 / f16
        if np.dtype(mdt).itemsize == 1:
            grid = np.arange(256, dtype=np.uint8).view(mdt).astype(np.float64)
        else:
            grid = np.arange(2**16, dtype=np.uint16).view(mdt).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (grid[1:] + grid[:-1]) / 2)  # ties are exact in fp32
    around = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    return np.concatenate([raw, logu, grid.astype(np.float32), around, np.float32([0.0, -0.0])])


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_convert_matches_ml_dtypes(rng, name):
    """_f32.convert (RNE, gradual underflow, satfinite where the format saturates) == ml_dtypes' cast of the value
    clipped to +-max (satfinite formats) or not clipped (bf16 / f16 overflow to inf), bit for bit."""
    target, mdt, smax = TARGETS[name]
    x = _values(rng, mdt)
    want_in = np.clip(x, -smax, smax) if smax is not None else x
    with np.errstate(over="ignore"):  # f16: overflow to inf is the expected result
        want = want_in.astype(mdt)
    nbits = 4 if name == "e2m1" else 8 * np.dtype(mdt).itemsize
    want_codes = want.view(np.uint8 if nbits <= 8 else np.uint16).astype(np.uint32) & ((1 << nbits) - 1)
    got = np.asarray(convert(jnp.asarray(x), target))
    bad = np.nonzero(got != want_codes)[0]
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want_codes[i])) for i in bad[:8]]


def test_special_values_vs_ml_dtypes():
    """Where the hardware (satfinite) rules and ml_dtypes' casts part (recorded, not a reference error):
      NaN -> E2M1: reference +6 (0x7, docs/numerics.md s1); ml_dtypes / XLA give 0x8 (-0).
      NaN -> E5M2: reference 0x7F (CUDA's canonical NaN); ml_dtypes / XLA give 0x7E (also a NaN).
      +-inf -> E4M3 / E5M2 / E2M1: reference saturates to +-max; ml_dtypes gives NaN (e4m3fn), inf (e5m2).
    """
    x = jnp.asarray(np.float32([np.nan, -np.nan, np.inf, -np.inf]))
    assert np.asarray(convert(x, _f32.E2M1)).tolist() == [0x7, 0x7, 0x7, 0xF]
    assert np.asarray(convert(x, _f32.E4M3)).tolist() == [0x7F, 0x7F, 0x7E, 0xFE]
    assert np.asarray(convert(x, _f32.E5M2)).tolist() == [0x7F, 0x7F, 0x7B, 0xFB]
    nan = np.float32([np.nan])
    assert nan.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0] & 0xF == 0x8
    assert nan.astype(ml_dtypes.float8_e5m2).view(np.uint8)[0] == 0x7E
    assert np.isnan(np.float32([np.inf]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)[0])


def _numpy_keeps_subnormals():
    return np.float32(2.0**-70) * np.float32(2.0**-70) == np.float32(2.0**-140)


@pytest.mark.skipif(not _numpy_keeps_subnormals(), reason="numpy runs with FTZ/DAZ here; no IEEE oracle")
def test_f32_mul_div_recip_match_ieee(rng):
    """_f32.mul / div / recip (integer emulation, subnormals kept) == numpy's IEEE fp32 *, / and 1/x, bit for bit,
    on random bit patterns (every exponent, subnormals, inf, NaN) and results straddling the subnormal range."""
    a = rng.integers(0, 2**32, 30000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    b = rng.integers(0, 2**32, 30000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    e = rng.integers(-75, 0, 30000)
    c = (rng.uniform(1, 2, 30000) * 2.0**e).astype(np.float32)
    d = (rng.uniform(1, 2, 30000) * 2.0 ** (-130 - e)).astype(np.float32)  # products around 2**-130
    a, b = np.concatenate([a, c]), np.concatenate([b, d])
    with np.errstate(all="ignore"):
        b_div = np.concatenate([b[: len(b) - len(d)], np.float32(1) / d])  # c / (1/d): quotients near 2**-130
        want_mul, want_rcp, want_div = a * b, np.float32(1) / a, a / b_div
    got_mul = np.asarray(jax.jit(_f32.mul)(jnp.asarray(a), jnp.asarray(b)))
    got_rcp = np.asarray(jax.jit(_f32.recip)(jnp.asarray(a)))
    got_div = np.asarray(jax.jit(_f32.div)(jnp.asarray(a), jnp.asarray(b_div)))
    for got, want in ((got_mul, want_mul), (got_rcp, want_rcp), (got_div, want_div)):
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), [(a[i], b[i], got[i], want[i]) for i in np.nonzero(~same)[0][:5]]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_output_dtype_is_one_rne_rounding(rng, dtype):
    """dequantize(q, bf16/f16) == ml_dtypes/numpy RNE cast of dequantize(q, f32) (one rounding, overflow -> inf),
    except MXFP8 codes just past the output's range whose rounding interval reaches into it, which give +-max
    (docs/numerics.md section 2): decoded magnitudes in (max, 1.25 max] may give either, beyond they give inf."""
    x = jnp.asarray((rng.standard_normal((32, 64)) * 10.0 ** rng.uniform(-8, 6, (32, 1))).astype(np.float32))
    top = float(jnp.finfo(dtype).max)
    # 1.25 max as float32; bf16's lies past float32's range, so the band reaches inf
    edge = np.float32(1.25 * top) if 1.25 * top <= float(np.finfo(np.float32).max) else np.float32(np.inf)
    for fmt in (jax_fp4.NVFP4(), jax_fp4.MXFP8()):
        q = quantize(x, fmt)
        f32 = np.asarray(dequantize(q))
        with np.errstate(over="ignore"):
            want = f32.astype(np.dtype(dtype))
        got = np.asarray(dequantize(q, dtype))
        band = (np.abs(f32) > top) & (np.abs(f32) <= edge) if isinstance(fmt, jax_fp4.MXFP8) else False
        np.testing.assert_array_equal(np.where(band, 0, got.view(np.uint16)), np.where(band, 0, want.view(np.uint16)))
        assert np.isin(np.abs(got[band].astype(np.float32)), [top, np.inf]).all()


# ---- jax.nn (jax._src.cudnn.scaled_matmul_stablehlo.quantize, behind jax.nn.scaled_dot_general) ------------
def _jnn():
    mod = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")
    if not hasattr(mod, "quantize") or not hasattr(mod, "BlockScaleConfig"):
        pytest.skip("jax.nn's block-scale quantize helper moved")
    return mod


def _jnn_quantize(x, mode, data_type, global_scale=None):
    mod = _jnn()
    scale_type = jnp.float8_e8m0fnu if mode == "mxfp8" else jnp.float8_e4m3fn
    cfg = mod.BlockScaleConfig(mode=mode, block_size=32 if mode == "mxfp8" else 16, data_type=data_type,
                               scale_type=scale_type, global_scale=global_scale, infer_only=False)
    d, s = jax.jit(lambda v: mod.quantize(v, cfg))(jnp.asarray(x))
    return codes_of(d), codes_of(s)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_mxfp8_agrees_with_jax_nn_on_normal_data(rng, element):
    """Finite data whose block scales stay normal (amax >= 448 * 2**-126): jax.nn computes amax / max (a division)
    and x / 2**(e-127), we compute amax * fp32(1/max) and x * 2**(127-e); the E8M0 round-up rule and the RNE casts
    are the same. Division vs reciprocal multiplication can only disagree when one result is exactly a power of
    two and the other is not; amaxes within +-1500 fp32 ulps of max * 2**k are included to hit that case: none
    differs (fp32(1/448) * 448 rounds to exactly 1.0)."""
    fmt = jax_fp4.MXFP8(element=element)
    x = (rng.standard_normal((96, 256)) * 10.0 ** rng.uniform(-25, 30, (96, 1))).astype(np.float32)
    near = (np.float32(fmt.max_value).view(np.uint32) + np.arange(-1500, 1500)).astype(np.uint32).view(np.float32)
    xs = np.zeros((3000 * 3, 32), np.float32)
    xs[:, 0] = np.concatenate([near * np.float32(2.0**k) for k in (-100, 0, 90)])
    xs[:, 1:] = rng.uniform(-1, 1, (9000, 31)).astype(np.float32) * xs[:, :1]
    for data in (x, xs):
        jd, js = _jnn_quantize(data, "mxfp8", fmt.data_dtype)
        q = quantize(jnp.asarray(data), fmt)
        np.testing.assert_array_equal(codes_of(q.scale), js)
        np.testing.assert_array_equal(codes_of(q.data), jd)


def _e8m0_np(v):
    """The E8M0 rule of docs/numerics.md s2 in numpy (v >= 0 finite)."""
    b = v.view(np.uint32)
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    return e + ((m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000)))


@pytest.mark.parametrize("max_norm,exps", [(448.0, [135] + list(range(0, 10))), (57344.0, [135, 0, 16, 17])])
def test_e8m0_division_equals_reciprocal_product_exhaustively(max_norm, exps):
    """Every fp32 amax of the given binades (biased exponent fields `exps`, all 2**23 mantissas each): the reference's
    e8m0(amax * fp32(1/max)) == e8m0(amax / max) with IEEE division (numpy), i.e. the rule jax.nn uses. Binade 135
    ([256, 512)) covers every amax whose v is normal (scaling by 2**k is exact there); the low binades cover the
    subnormal v range. So the division in jax.nn's recipe is never the source of an MXFP8 scale difference."""
    f = jax.jit(lambda a: ref_mxfp8.e8m0_from_float(_f32.mul(a, np.float32(1 / max_norm))))
    for ex in exps:
        a = (np.arange(2**23, dtype=np.uint32) | np.uint32(ex << 23)).view(np.float32)
        with np.errstate(under="ignore"):
            want = _e8m0_np(a / np.float32(max_norm))
        got = np.asarray(f(jnp.asarray(a)))
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, [(float(a[i]), int(got[i]), int(want[i])) for i in bad[:5]]


# (block leading values, our E8M0 code and data codes [hand-derived, see test_edge_table_mxfp8], jax.nn's under
# jax.jit on CPU). XLA:CPU runs with denormals flushed (FTZ/DAZ) and rewrites x / broadcast(s) as
# x * broadcast(1/s); eager jax.nn differs again (e.g. a zero block gives NaN data there: 0 / flushed 2**-127).
JNN_DIFFERENCES = [
    # NaN: jax.nn's amax is NaN; its exponent 0xFF is bumped and wraps to E8M0 0; 1 * 2**127 -> clipped to 448.
    # We ignore NaN (fmax): amax 1 -> v = fp32(1/448) -> e = 119; 1 * 2**8 = 256 (0x78); NaN -> 0x7F.
    ("NaN in block", [np.nan, 1.0], (119, [0x7F, 0x78]), (0x00, [0x7F, 0x7E])),
    # inf: jax.nn's v = inf has exponent 0xFF, mantissa 0 -> not bumped -> 0xFF (the NaN scale); inf * 0 = NaN,
    # 1 * 0 = 0. Ours: 0xFE, inf saturates to 448, 1 * 2**-127 -> 0.
    ("inf in block", [np.inf, 1.0], (0xFE, [0x7E, 0x00]), (0xFF, [0xFF, 0x00])),
    # amax 2**-117.5 (normal): v = 1.6 * 2**-127 is an fp32 subnormal with mantissa > 0x400000 -> ours e = 1,
    # 2**-117.5 * 2**126 = 2**8.5 = 362 -> 352 (0x7B). jax.nn flushes v to 0 -> e = 0; 2**9.5 -> clipped to 448.
    ("subnormal v", [2.0**-117.5], (0x01, [0x7B]), (0x00, [0x7E])),
    # all-subnormal block: ours keeps them: 2**-130 * 2**127 = 0.125 (0x20); jax.nn flushes the input to 0.
    ("subnormal data", [2.0**-130], (0x00, [0x20]), (0x00, [0x00])),
]


def test_mxfp8_differences_from_jax_nn_recorded():
    """Where jax.nn's quantize (on CPU, jax 0.10.2) departs from docs/numerics.md s2. Our codes are asserted always;
    jax.nn's are asserted against the recorded behaviour only on jax 0.10.x (they document it, not a contract)."""
    x = np.zeros((len(JNN_DIFFERENCES), 32), np.float32)
    for i, (_, vals, _, _) in enumerate(JNN_DIFFERENCES):
        x[i, : len(vals)] = vals
    q = quantize(jnp.asarray(x), jax_fp4.MXFP8())
    ours_s, ours_d = codes_of(q.scale), codes_of(q.data)
    jd, js = _jnn_quantize(x, "mxfp8", jnp.float8_e4m3fn)
    for i, (what, _vals, (e, d), (je, jdd)) in enumerate(JNN_DIFFERENCES):
        assert ours_s[i, 0] == e and ours_d[i, : len(d)].tolist() == d, what
        assert (ours_s[i, 0], ours_d[i, : len(d)].tolist()) != (js[i, 0], jd[i, : len(d)].tolist()), what
        if jax.__version__.startswith("0.10."):
            assert js[i, 0] == je and jd[i, : len(jdd)].tolist() == jdd, (what, js[i, 0], jd[i, :4])


def test_nvfp4_vs_jax_nn_with_unit_tensor_scale(rng):
    """jax.nn's nvfp4 mode has no tensor scale of its own (the caller passes global_scale); with amax = 2688 our
    S_enc is 1, so global_scale = 1 is the same setting. It takes s_b = e4m3(clip(amax / 6)) (a division; ours
    amax * fp32(1/6)) and x / s_b (ours x * fl(1/s_b), TE's e_b). They agree bit for bit, even where an exactly
    rounded division would not: block [11.25, 4.6875, 2.34375]: s_b = 11.25/6 = 1.875 (0x3F); fl(1/1.875) =
    0.53333336 > 8/15, so 4.6875 * fl(1/1.875) = 2.5000002 -> 3 (0x5) and 2.34375 * it = 1.2500001 -> 1.5 (0x3),
    whereas the exact quotients 2.5 and 1.25 are ties -> 2 (0x4) and 1 (0x2) (numpy below). jax.nn matches us
    because XLA:CPU compiles x / broadcast(s) as x * broadcast(1/s): an IEEE-dividing implementation of the
    jax.nn recipe (or another backend) would differ from docs/numerics.md at such ties."""
    x = (rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-2, 2, (64, 1))).astype(np.float32)
    x[0, 0] = 2688.0
    x[1, :16] = 0
    x[1, :3] = [11.25, 4.6875, 2.34375]
    one = jnp.ones((1,), jnp.float32)
    jd, js = _jnn_quantize(x, "nvfp4", jnp.float4_e2m1fn, global_scale=one)
    q = quantize(jnp.asarray(x), jax_fp4.NVFP4())
    d, s = codes_of(q.data), codes_of(q.scale)
    assert s[1, 0] == 0x3F and d[1, :3].tolist() == [7, 5, 3]
    np.testing.assert_array_equal(s, js)
    np.testing.assert_array_equal(d, jd)
    exact = (np.float32([11.25, 4.6875, 2.34375]) / np.float32(1.875)).astype(ml_dtypes.float4_e2m1fn)
    assert (exact.view(np.uint8) & 0xF).tolist() == [7, 4, 2]


def test_extreme_magnitudes_reference_only():
    """Sanity of the extremes the cross-checks above exclude: FLT_MAX and 2**-149 inputs quantize (MXFP8 e4m3) to
    the hand codes of test_edge_table_mxfp8 (FLT_MAX -> e = 0xF7, 256; 2**-149 alone -> e = 0, 2**-22 -> 0)."""
    x = np.zeros((2, 32), np.float32)
    x[0, 0], x[1, 0] = FLT_MAX, p2(-149)
    q = quantize(jnp.asarray(x), jax_fp4.MXFP8())
    assert codes_of(q.scale)[:, 0].tolist() == [0xF7, 0x00] and codes_of(q.data)[:, 0].tolist() == [0x78, 0x00]
