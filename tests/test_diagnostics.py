"""jax_fp4.diagnostics and jax_fp4.flax.diagnostics on the CPU.

* the statistics of all six GEMM operands of a small `jax_fp4.flax.nnx.Dense` (NVFP4 forward, MXFP8 backward),
  gathered inside one `nnx.jit` value-and-grad, equal an independent numpy computation: the NVFP4 and MXFP8 encodes
  of docs/numerics.md written with ml_dtypes casts (E4M3 / E2M1 / E8M0), and the statistics' definitions;
* the instrumented step returns the plain step's loss and gradients, and leaves the model's state as it was;
* hand-made edge cases: saturation, flush to zero and scale underflow / overflow on blocks built for them (MXFP8
  and NVFP4 through `operand_stats`); an unquantized operand (+inf dB, zero fractions);
* an RHT operand: its SNR equals the SNR computed in the original domain (orthogonal transform).
"""

from __future__ import annotations

import pytest

pytest.importorskip("flax")
ml_dtypes = pytest.importorskip("ml_dtypes")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import MXFP8 as MXFP8Format  # noqa: E402
from jax_fp4 import NVFP4 as NVFP4Format  # noqa: E402
from jax_fp4 import diagnostics as D  # noqa: E402
from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax import diagnostics as FD  # noqa: E402
from jax_fp4.flax import nnx as fnnx  # noqa: E402

F32 = np.float32


def _np_nvfp4(x):
    """(dequantized, codes, block scales per element) of NVFP4 1D (RNE) with blocks along the last axis."""
    r, c = x.shape
    amax = F32(np.max(np.abs(x)))
    s_enc = F32(2688) / amax
    bamax = np.abs(x).reshape(r, c // 16, 16).max(-1)
    sb = np.minimum(bamax * (s_enc * F32(1 / 6)), F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    with np.errstate(divide="ignore"):
        eb = np.minimum(F32(1) / (sb * (F32(1) / s_enc)), np.finfo(F32).max).astype(F32)
    v = np.clip(x * np.repeat(eb, 16, -1), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    return v * np.repeat((sb * amax) * F32(1 / 2688), 16, -1), v, sb, (F32(2.0**-6), F32(448))


def _np_mxfp8(x):
    """(dequantized, codes, block scales) of MXFP8 E4M3 with blocks along the last axis."""
    r, c = x.shape
    v = np.abs(x).reshape(r, c // 32, 32).max(-1).astype(F32) * F32(1 / 448)
    bits = v.view(np.uint32)
    e, mant = ((bits >> 23) & 0xFF).astype(np.int64), bits & 0x7FFFFF
    e = e + ((mant != 0) & (e != 0xFE) & ~((e == 0) & (mant <= 0x400000)))
    scale = np.ldexp(F32(1), (e - 127).astype(np.int32)).astype(F32)
    q = (x * np.repeat(np.ldexp(F32(1), (127 - e).astype(np.int32)).astype(F32), 32, -1))
    q = q.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return q * np.repeat(scale, 32, -1), q, scale, (F32(2.0**-126), F32(2.0**127))


def _np_stats(x, quant, blocks_along):
    """The six statistics of x [R, C] with blocks along axis `blocks_along` (0 or 1), in numpy float64."""
    x = np.asarray(x, F32)
    xb = x if blocks_along == 1 else x.T
    dq, codes, sb, (lo, hi) = quant(xb)
    bs = xb.shape[1] // sb.shape[1]
    fmax = 6.0 if quant is _np_nvfp4 else 448.0
    sat = (np.abs(codes) == fmax) & (np.repeat(sb, bs, -1) > 0) & (np.abs(xb) > np.abs(dq))
    nz = xb != 0
    err = xb.astype(np.float64) - dq
    blk = lambda a: a.reshape(a.shape[0], -1, bs).any(-1)  # noqa: E731
    return np.array([10 * np.log10(np.sum(xb.astype(np.float64) ** 2) / np.sum(err**2)), sat.mean(),
                     (nz & (dq == 0)).sum() / nz.sum(), (blk(nz) & (sb < lo)).mean(), (blk(sat) & (sb >= hi)).mean(),
                     np.abs(x).max()])


def test_dense_stats_match_numpy():
    rng = np.random.default_rng(0)
    recipe = recipes.NVFP4Fwd_MXFP8Bwd()
    layer = fnnx.Dense(64, 96, recipe=recipe, rngs=nnx.Rngs(0))
    # heavy-tailed activations with a few tiny rows: saturation, flushes and E4M3 scale underflow all occur
    x = rng.standard_t(3, (2, 64, 64)).astype(F32)
    x[0, :3] *= 1e-6
    c = rng.standard_normal((2, 64, 96)).astype(F32)  # dy = c: the loss is sum(y * c)

    def loss(model, x):
        return jnp.sum(model(x) * c)

    @nnx.jit
    def step(model, x):
        return FD.value_and_grad(loss)(model, x)

    value, grads, stats = step(layer, jnp.asarray(x))
    assert set(stats) == {""} and stats[""].shape == (6, 6)  # the layer itself is the root: path ""
    s = np.asarray(stats[""], np.float64)
    w = np.asarray(layer.kernel[...])
    x2, dy = x.reshape(128, 64), c.reshape(128, 96)
    expect = {"fprop_x": _np_stats(x2, _np_nvfp4, 1), "fprop_w": _np_stats(w, _np_nvfp4, 0),
              "dgrad_dy": _np_stats(dy, _np_mxfp8, 1), "dgrad_w": _np_stats(w, _np_mxfp8, 1),
              "wgrad_x": _np_stats(x2, _np_mxfp8, 0), "wgrad_dy": _np_stats(dy, _np_mxfp8, 0)}
    for i, op in enumerate(D.OPERANDS):
        np.testing.assert_allclose(s[i, 0], expect[op][0], rtol=1e-4, err_msg=op)  # SNR: float32 sums
        np.testing.assert_allclose(s[i, 1:], expect[op][1:], rtol=1e-6, atol=1e-7, err_msg=op)
    assert s[0, 1] > 0 and s[0, 2] > 0 and s[0, 3] > 0  # the data was built to show each effect

    v2, g2 = nnx.jit(nnx.value_and_grad(loss))(layer, jnp.asarray(x))
    assert float(value) == float(v2)
    np.testing.assert_array_equal(grads["kernel"][...], g2["kernel"][...])
    assert layer.quant_probe is None and set(nnx.to_pure_dict(nnx.state(layer))) == {"kernel", "bias"}


def test_edge_cases():
    x = np.ones((2, 64), F32)
    x[0, :32] = 0
    x[0, 5] = 2.0**-120  # a lone tiny value: its MXFP8 block scale would be 2^-128.8, clamps at 2^-127 (underflow)
    x[1, 40] = 3e38  # near FLT_MAX: E8M0 still covers it (448 * 2^127 > FLT_MAX), no scale overflow
    s = np.asarray(D.operand_stats(jnp.asarray(x), MXFP8Format()))
    assert s[3] == pytest.approx(1 / 4) and s[4] == 0  # of the 4 blocks, one (nonzero) underflows
    assert s[5] == pytest.approx(3e38)
    u = np.asarray(D.operand_stats(jnp.ones((4, 32)), None))
    assert np.isinf(u[0]) and np.all(u[1:5] == 0) and u[5] == 1
    # NVFP4: a block 1e-9 times smaller than the tensor amax has an E4M3 scale of 0: flushed whole (underflow)
    y = np.ones((1, 64), F32)
    y[0, 16:32] = 1e-9
    s = np.asarray(D.operand_stats(jnp.asarray(y), NVFP4Format()))
    assert s[2] == pytest.approx(0.25) and s[3] == pytest.approx(0.25) and s[1] == 0 and s[4] == 0


def test_rht_snr_is_domain_independent():
    x = np.random.default_rng(1).standard_normal((64, 32)).astype(F32)
    fmt = NVFP4Format(rht=True)
    s = D.operand_stats(jnp.asarray(x, jnp.bfloat16), fmt, axis=0)
    from jax_fp4 import dequantize, quantize

    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    err = xb - np.asarray(dequantize(quantize(jnp.asarray(x, jnp.bfloat16), fmt, axis=0)), np.float64)
    np.testing.assert_allclose(float(s[0]), 10 * np.log10(np.sum(xb**2) / np.sum(err**2)), rtol=1e-4)

