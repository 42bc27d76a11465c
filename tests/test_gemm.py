"""`scaled_dot_general` on the CPU: the emulated product against float64 products of the same quantized operands.

* every format pairing the recipes use (NVFP4 1D, NVFP4 2D weight, MXFP8 E4M3 and E5M2 x E4M3, NVFP4 1x64, the RHT
  wgrad pair) and the three GEMM orientations (x[M,K].w[K,N], x[M,K].w[N,K], wgrad x[M,K].dy[M,N] over M) against
  the exactly decoded operands (`_gemm_util.decode`), within the bound derived in `_gemm_util` (fp32 accumulation
  over K plus the tensor-scale roundings, nothing tuned); the same bound must reject the unquantized product;
* against `jax_fp4.dequantize` operands (its own fp32 roundings added to the bound; for RHT operands, whose
  dequantize applies the inverse transform, the inverse's rounding bound as well);
* compact == swizzled scales; the trace-time errors; the native-path choice (jax.nn.scaled_matmul monkeypatched with
  a recorder, since the CPU has no block-scaled GEMM); an MXFP8 cross-check against `jax.nn.scaled_dot_general`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import (
    SLACK,
    assert_within,
    chunk_l1,
    decode,
    documented_scaled_matmul,
    dot64,
    f64,
    gamma,
    operand_bound,
    violates,
)
from _quantize_util import bits, jq

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4 import route as route_module

M, K, N = 128, 128, 64
KEY = jax.random.key(7)

# dimension numbers: name -> (lhs operand, rhs operand, dimension_numbers, contracted length)
#   lhs/rhs operand: (input name, block axis) with inputs x[M, K], w[K, N], wt[N, K], dy[M, N]
ORIENTATIONS = {
    "x.w[K,N]": (("x", -1), ("w", 0), (((1,), (0,)), ((), ())), K),
    "x.w[N,K]": (("x", -1), ("wt", -1), (((1,), (1,)), ((), ())), K),
    "wgrad x.dy": (("x", 0), ("dy", 0), (((0,), (0,)), ((), ())), M),
}
NV, NV2D, NVRHT, NV64 = NVFP4(), NVFP4(scaling_2d=True), NVFP4(rht=True), NVFP4(local_1x64=True)
MX4, MX5 = MXFP8(), MXFP8(element="e5m2")
PAIRS = {  # name -> (lhs format, rhs format, orientations)
    "nvfp4": (NV, NV, list(ORIENTATIONS)),
    "nvfp4 x nvfp4-2d-weight": (NV, NV2D, ["x.w[K,N]", "x.w[N,K]"]),
    "mxfp8-e4m3": (MX4, MX4, list(ORIENTATIONS)),
    "mxfp8-e5m2 x e4m3": (MX5, MX4, ["x.w[N,K]", "wgrad x.dy"]),
    "nvfp4-1x64": (NV64, NV64, ["x.w[K,N]"]),
    "nvfp4-rht": (NVRHT, NVRHT, ["wgrad x.dy"]),
}
CASES = [(p, o) for p, (_, _, os) in PAIRS.items() for o in os]


def _inputs(rng):
    """bfloat16 inputs: standard normal rows with magnitudes spread over 2**[-3, 3] (varied block scales)."""
    def mk(shape):
        rows = 2.0 ** rng.uniform(-3, 3, (shape[0], 1))
        return jnp.asarray(rng.standard_normal(shape) * rows, jnp.bfloat16)
    return {"x": mk((M, K)), "w": mk((K, N)), "wt": mk((N, K)), "dy": mk((M, N))}


def _operands(rng, pair, orient):
    fa, fb, _ = PAIRS[pair]
    (na, axa), (nb, axb), dn, k = ORIENTATIONS[orient]
    xs = _inputs(rng)
    return jq(xs[na], fa, axa, KEY), jq(xs[nb], fb, axb, KEY), dn, k, (xs[na], xs[nb])


@functools.partial(jax.jit, static_argnames=("dimension_numbers", "implementation"))
def jgemm(a, b, dimension_numbers, implementation="emulated"):
    return jax_fp4.scaled_dot_general(a, b, dimension_numbers, implementation=implementation)


jdequantize = jax.jit(jax_fp4.dequantize)


@pytest.mark.parametrize("pair,orient", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_emulated_equals_fp64_product_of_the_operands(rng, pair, orient):
    """Within gemm_bound of the float64 product of the decoded operands (RHT: inverse-transformed, i.e. x.T @ dy
    of the original-domain values; H is orthogonal, so the exact products agree); the unquantized product is not."""
    a, b, dn, k, raw = _operands(rng, pair, orient)
    got = jgemm(a, b, dn)
    ref, bound = operand_bound(a, b, dn, k)
    assert got.dtype == jnp.float32 and got.shape == ref.shape
    assert_within(got, ref, bound, f"{pair} {orient}")
    unquantized = dot64(f64(raw[0]), f64(raw[1]), dn)[0]
    assert violates(unquantized, ref, bound), "the bound cannot tell the quantized product from the unquantized one"


def test_preferred_element_type_rounds_the_fp32_result(rng):
    a, b, dn, _, _ = _operands(rng, "nvfp4", "x.w[K,N]")
    f32 = jgemm(a, b, dn)
    bf = jax.jit(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn, jnp.bfloat16, implementation="emulated"))(a, b)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(bf), bits(f32.astype(jnp.bfloat16)))


# ---- against jax_fp4.dequantize operands -----------------------------------------------------------------------------
def _dequantize_roundings(q) -> int:
    """fp32 roundings in each dequantize(q, float32) value relative to its exact value (NVFP4: (s_b * amax) *
    fp32(1/2688), then value * f; 1x64: the division by S_enc,w; MXFP8: exact). RHT handled separately."""
    if isinstance(q.fmt, NVFP4):
        return 1 if q.fmt.local_1x64 else 3
    return 0


@pytest.mark.parametrize("pair,orient", [("nvfp4", "x.w[K,N]"), ("nvfp4 x nvfp4-2d-weight", "x.w[N,K]"),
                                         ("mxfp8-e4m3", "wgrad x.dy"), ("nvfp4-1x64", "x.w[K,N]"),
                                         ("nvfp4-rht", "wgrad x.dy")])
def test_emulated_equals_fp64_product_of_dequantized_operands(rng, pair, orient):
    """The reference is the float64 product of `jax_fp4.dequantize(q, float32)` (the issue's formulation).

    |R - D_dq| <= |R - E| + |E - D_dq|: the first term is gemm_bound (see _gemm_util); the second is
    gamma_(ra + rb) * A for ra, rb dequantize's roundings per value, and for the RHT pair (dequantize applies the
    inverse transform in fp32) gamma_7 (2 + gamma_7) sum_m alpha_m beta_m with alpha, beta the transformed operands'
    16-chunk l1 norms / 4 (derivation in _gemm_util)."""
    a, b, dn, k, _ = _operands(rng, pair, orient)
    got = jgemm(a, b, dn)
    da, db = jdequantize(a), jdequantize(b)
    assert da.dtype == db.dtype == jnp.float32
    ref_dq = dot64(f64(da), f64(db), dn)[0]
    _, bound = operand_bound(a, b, dn, k)
    if isinstance(a.fmt, NVFP4) and a.fmt.rht:
        ta, tb = decode(a, inverse_rht=False), decode(b, inverse_rht=False)
        ab = dot64(chunk_l1(ta, a.axis), chunk_l1(tb, b.axis), dn)[0]
        dq_err = (gamma(7) * (2 + gamma(7)) + SLACK) * ab
    else:
        absprod = dot64(decode(a), decode(b), dn)[1]
        dq_err = (gamma(_dequantize_roundings(a) + _dequantize_roundings(b)) + SLACK) * absprod
    assert_within(got, ref_dq, bound + dq_err, f"{pair} {orient} vs dequantize")
    # dequantize itself agrees with the exact decoding (per value: its own roundings; RHT: gamma_7 * alpha)
    for q, d in ((a, da), (b, db)):
        exact = decode(q)
        if isinstance(q.fmt, NVFP4) and q.fmt.rht:
            tol = (gamma(7) + SLACK) * chunk_l1(decode(q, inverse_rht=False), q.axis)
        else:
            tol = (gamma(_dequantize_roundings(q)) + SLACK) * np.abs(exact)
        assert_within(d, exact, tol, f"dequantize({q!r})")


# ---- layouts, errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair,orient", [("nvfp4", "x.w[K,N]"), ("mxfp8-e4m3", "wgrad x.dy"),
                                         ("nvfp4 x nvfp4-2d-weight", "x.w[N,K]")])
def test_swizzled_scales_give_the_same_product(rng, pair, orient):
    a, b, dn, _, _ = _operands(rng, pair, orient)
    sa, sb = jax_fp4.swizzle_scales(a), jax_fp4.swizzle_scales(b)
    assert sa.scale_layout == sb.scale_layout == "swizzled"
    assert not np.array_equal(bits(sa.scale).reshape(-1), bits(a.scale).reshape(-1))  # really permuted
    np.testing.assert_array_equal(bits(jgemm(sa, sb, dn)), bits(jgemm(a, b, dn)))
    np.testing.assert_array_equal(bits(jgemm(sa, b, dn)), bits(jgemm(a, b, dn)))


def test_errors(rng):
    xs = _inputs(rng)
    x_row, dy_col = jq(xs["x"], NV, -1), jq(xs["dy"], NV, 0)
    wgrad = ORIENTATIONS["wgrad x.dy"][2]
    with pytest.raises(ValueError, match=r"block axis .* lhs .* contracting"):
        jax_fp4.scaled_dot_general(x_row, dy_col, wgrad)  # x's blocks run along K, the contraction is over M
    x_rht, dy_rht = jq(xs["x"], NVRHT, 0), jq(xs["dy"], NVRHT, 0)
    with pytest.raises(ValueError, match="RHT operands come in pairs"):
        jax_fp4.scaled_dot_general(x_rht, dy_col, wgrad)
    with pytest.raises(ValueError, match="RHT operands come in pairs"):
        jax_fp4.scaled_dot_general(jq(xs["x"], NV, 0), dy_rht, wgrad)
    w_col = jq(xs["w"], NV, 0)
    fprop = ORIENTATIONS["x.w[K,N]"][2]
    assert not route_module.native_gemm_available()  # the CPU (native on request: tests/test_gemm_native.py)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax_fp4.scaled_dot_general(x_row, w_col, fprop, implementation="cudnn")
    with pytest.raises(ValueError, match="must be a jax_fp4.QuantizedArray"):
        jax_fp4.scaled_dot_general(x_row, xs["w"], fprop)


# ---- the native path's choice and operands (CPU: jax.nn.scaled_matmul replaced by a recorder) ------------------------
@pytest.fixture
def native_recorder(monkeypatch):
    """Pretend the device has block-scaled tensor cores; record (and compute) every jax.nn.scaled_matmul call."""
    original = jax.nn.scaled_matmul
    calls = []

    def recorder(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        calls.append(dict(lhs=(lhs.shape, lhs.dtype), rhs=(rhs.shape, rhs.dtype),
                          lhs_scales=(lhs_scales.shape, lhs_scales.dtype),
                          rhs_scales=(rhs_scales.shape, rhs_scales.dtype), out=preferred_element_type))
        try:  # jax >= 0.11 lowers scaled_matmul on the CPU (its own decomposition)
            return original(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=preferred_element_type)
        except NotImplementedError:  # older jax: no CPU lowering
            return documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type)

    monkeypatch.setattr(route_module, "native_gemm_available", lambda: True)
    monkeypatch.setattr(jax.nn, "scaled_matmul", recorder)
    return calls


# (pair, orientation) -> expected shapes of (lhs, rhs, lhs_scales, rhs_scales), dtypes of (lhs, rhs, scales)
NATIVE_CASES = {
    ("mxfp8-e4m3", "x.w[K,N]"): ((1, M, K), (1, N, K), (1, M, K // 32), (1, N, K // 32),
                                 (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)),
    ("mxfp8-e5m2 x e4m3", "wgrad x.dy"): ((1, K, M), (1, N, M), (1, K, M // 32), (1, N, M // 32),
                                          (jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)),
    ("nvfp4", "x.w[N,K]"): ((1, M, K), (1, N, K), (1, M, K // 16), (1, N, K // 16),
                            (jnp.float4_e2m1fn, jnp.float4_e2m1fn, jnp.float8_e4m3fn)),
    ("nvfp4", "wgrad x.dy"): ((1, K, M), (1, N, M), (1, K, M // 16), (1, N, M // 16),
                              (jnp.float4_e2m1fn, jnp.float4_e2m1fn, jnp.float8_e4m3fn)),
}


@pytest.mark.parametrize("case", list(NATIVE_CASES), ids=[f"{p}-{o}" for p, o in NATIVE_CASES])
@pytest.mark.parametrize("layout", ["compact", "swizzled"])
def test_native_path_operands(rng, native_recorder, case, layout):
    """auto -> jax.nn.scaled_matmul with [1, rows, K] data (contracting axis last) and compact scales; its result,
    times the NVFP4 tensor scales, is within gemm_bound of the fp64 product; "emulated" does not call it."""
    pair, orient = case
    a, b, dn, k, _ = _operands(rng, pair, orient)
    if layout == "swizzled":
        a, b = jax_fp4.swizzle_scales(a), jax_fp4.swizzle_scales(b)
    got = jax_fp4.scaled_dot_general(a, b, dn)  # eager: the patched functions are looked up at trace time
    sl, sr, ssl, ssr, (lhs_dt, rhs_dt, scale_dt) = NATIVE_CASES[case]
    assert len(native_recorder) == 1
    call = native_recorder[0]
    assert call["lhs"] == (sl, jnp.dtype(lhs_dt)) and call["rhs"] == (sr, jnp.dtype(rhs_dt)), call
    assert call["lhs_scales"] == (ssl, jnp.dtype(scale_dt)) and call["rhs_scales"] == (ssr, jnp.dtype(scale_dt)), call
    assert jnp.dtype(call["out"]) == jnp.float32
    ref, bound = operand_bound(a, b, dn, k)
    assert_within(got, ref, bound, f"native {pair} {orient}")
    jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn, implementation="emulated"), a, b)
    assert len(native_recorder) == 1  # "emulated" never takes the native path


@pytest.mark.parametrize("pair,orient", [("nvfp4 x nvfp4-2d-weight", "x.w[K,N]"), ("nvfp4-rht", "wgrad x.dy"),
                                         ("nvfp4-1x64", "x.w[K,N]")])
def test_native_path_not_taken_for_2d_rht_1x64(rng, native_recorder, pair, orient):
    a, b, dn, _, _ = _operands(rng, pair, orient)
    out = jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn), a, b)  # tracing decides the path
    assert native_recorder == [] and out.shape == ((K, N) if orient == "wgrad x.dy" else (M, N))
    with pytest.raises(ValueError, match="no native block-scaled GEMM"):
        jax_fp4.scaled_dot_general(a, b, dn, implementation="native")


def test_native_path_not_taken_for_batch_dims_or_mixed_formats(rng, native_recorder):
    xs = _inputs(rng)
    x3 = xs["x"].reshape(2, M // 2, K)
    a, b = jq(x3, MX4, -1), jq(xs["wt"], MX4, -1)
    dn3 = (((2,), (1,)), ((), ()))
    assert jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, dn3), a, b).shape == (2, M // 2, N)
    mixed_a, mixed_b = jq(xs["x"], NV, -1), jq(xs["wt"], MX4, -1)
    jax.eval_shape(lambda a, b: jax_fp4.scaled_dot_general(a, b, ORIENTATIONS["x.w[N,K]"][2]), mixed_a, mixed_b)
    assert native_recorder == []
    assert_within(jgemm(a, b, dn3), *operand_bound(a, b, dn3, K), "rank-3 mxfp8")
    ref, bound = operand_bound(mixed_a, mixed_b, ORIENTATIONS["x.w[N,K]"][2], K)
    assert_within(jgemm(mixed_a, mixed_b, ORIENTATIONS["x.w[N,K]"][2]), ref, bound, "nvfp4 x mxfp8")


# ---- jax.nn.scaled_dot_general (MXFP8) -------------------------------------------------------------------------------
def _mxfp8_quantization_error(x: np.ndarray) -> np.ndarray:
    """Per-element bound of |q(x) - x| for MXFP8 E4M3 along the last axis, valid for both rounding rules of the
    block scale (jax.nn: fl(amax / 448); ours: fl(amax * fp32(1/448)); either rounded up to 2**e, so 2**e <=
    2 * (amax / 448) * (1 + 2**-22)): E4M3 normals round with relative error <= 2**-4 (3 mantissa bits), subnormals
    (quantum 2**-9 * 2**e) with absolute error <= 2**-10 * 2**e."""
    blocks = np.abs(x).reshape(*x.shape[:-1], -1, 32)
    amax = np.repeat(blocks.max(-1), 32, axis=-1)
    return 2.0**-4 * np.abs(x) + 2.0**-10 * 2 * amax / 448 * (1 + 2.0**-22)


def _mxfp8_bound(x, w, k):
    """|q(x) q(w)^T - x w^T| <= sum_k e_x |w| + |x| e_w + e_x e_w, plus fp32 accumulation gamma_K sum |q(x)||q(w)|."""
    ex, ew = _mxfp8_quantization_error(x), _mxfp8_quantization_error(w)
    ax, aw = np.abs(x), np.abs(w)
    return ex @ aw.T + ax @ ew.T + ex @ ew.T + (gamma(k) + SLACK) * ((ax + ex) @ (aw + ew).T)


def _jax_nn_mxfp8_or_skip():
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    probe = jnp.ones((1, 32), jnp.float32)
    try:
        jax.nn.scaled_dot_general(probe, probe, (((1,), (1,)), ((), ())), configs=[cfg] * 3)
    except NotImplementedError as e:
        pytest.skip(f"jax {jax.__version__}: jax.nn.scaled_dot_general has no CPU lowering ({e})")
    return cfg


def test_mxfp8_against_jax_nn_scaled_dot_general(rng):
    """Both jax.nn.scaled_dot_general('mxfp8') and ours (quantize both operands, scaled_dot_general) lie within the
    MXFP8 E4M3 quantization bound of the exact product of the unquantized float32 inputs."""
    cfg = _jax_nn_mxfp8_or_skip()
    x = (rng.standard_normal((M, K)) * 2.0 ** rng.uniform(-3, 3, (M, 1))).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    dn = (((1,), (1,)), ((), ()))
    theirs = jax.nn.scaled_dot_general(jnp.asarray(x), jnp.asarray(w), dn, configs=[cfg] * 3)
    ours = jgemm(jq(jnp.asarray(x), MX4, -1), jq(jnp.asarray(w), MX4, -1), dn)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = _mxfp8_bound(x.astype(np.float64), w.astype(np.float64), K)
    assert_within(theirs, exact, bound, "jax.nn.scaled_dot_general mxfp8")
    assert_within(ours, exact, bound, "jax_fp4 mxfp8")


def _e8m0_round_up(v: np.ndarray) -> np.ndarray:
    """docs/numerics.md section 2 (and jax's cast_to_e8m0_with_rounding_up): exponent bits, +1 for a non-zero
    mantissa."""
    b = v.astype(np.float32).view(np.uint32)
    e, m = b >> 23, b & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    return (e + up).astype(np.uint8)


def test_mxfp8_codes_equal_jax_nn_quantize_where_the_scale_rules_coincide(rng):
    """jax.nn's MXFP8 quantize divides the block amax by 448, ours multiplies by fp32(1/448) (docs/numerics.md); on
    blocks where both give the same E8M0 exponent (computed here in numpy), scales and E4M3 codes must be identical."""
    try:
        from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_nn_quantize
    except ImportError as e:  # private API
        pytest.skip(f"jax {jax.__version__}: no jax._src.cudnn.scaled_matmul_stablehlo.quantize ({e})")
    x = (rng.standard_normal((M, K)) * 2.0 ** rng.uniform(-20, 20, (M, 1))).astype(np.float32)
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    jd, js = jax.jit(lambda x: jax_nn_quantize(x, cfg))(jnp.asarray(x)[None])
    q = jq(jnp.asarray(x), MX4, -1)
    amax = np.abs(x).reshape(M, K // 32, 32).max(-1)
    same_rule = _e8m0_round_up(amax / np.float32(448)) == _e8m0_round_up(amax * np.float32(1 / 448))
    assert same_rule.sum() >= same_rule.size // 2, "expected most blocks to be comparable"
    np.testing.assert_array_equal(bits(js[0])[same_rule], bits(q.scale)[same_rule])
    blk = np.repeat(same_rule, 32, axis=-1)
    np.testing.assert_array_equal(bits(jd[0])[blk], bits(q.data)[blk])

