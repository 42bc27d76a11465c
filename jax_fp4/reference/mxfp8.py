"""MXFP8 quantize / dequantize, bit-exact to docs/numerics.md section 2 (TE `quantize_mxfp8.cuh`,
`ptx_arch_spec.cuh float_to_e8m0`). Data oriented with the block axis last, as in `nvfp4`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_fp4.formats import MXFP8
from jax_fp4.reference import _f32, codes
from jax_fp4.reference.amax import abs_bits

U32 = jnp.uint32


def e8m0_from_float(v):
    """float_to_e8m0 (round toward +inf, saturating) of v >= 0: NaN -> 0xFF, inf -> 0xFE, 0 -> 0; else the exponent
    bits of v, plus one when the mantissa is nonzero, except when they are 0xFE, or 0 with mantissa <= 0x400000."""
    b = _f32.bits(v)
    exp, mant = (b >> 23) & U32(0xFF), b & U32(0x7FFFFF)
    bump = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= U32(0x400000)))
    e = exp + bump.astype(U32)
    mag = b & U32(0x7FFFFFFF)
    e = jnp.where(mag == U32(0x7F800000), U32(0xFE), e)
    return jnp.where(mag > U32(0x7F800000), U32(0xFF), e)


def _inverse_scale(e):
    """fp32 2**(127 - e): exponent field 254 - e for e <= 253, the subnormal 2**-127 for e = 254, NaN for 255."""
    b = jnp.where(e <= 253, (U32(254) - jnp.minimum(e, U32(253))) << 23, U32(0x00400000))
    return _f32.from_bits(jnp.where(e == 255, U32(0x7FC00000), b))


def _target(fmt: MXFP8):
    return _f32.E4M3 if fmt.element == "e4m3" else _f32.E5M2


def quantize(y, fmt: MXFP8):
    """y [..., n] (block axis last, n % 32 == 0) -> (uint32 data codes [..., n], uint32 E8M0 codes [..., n/32])."""
    y = _f32.widen(y)  # exact (subnormals kept on every platform)
    bs = fmt.block_size
    blocks = y.reshape(*y.shape[:-1], y.shape[-1] // bs, bs)
    bamax = _f32.from_bits(jnp.max(abs_bits(blocks), axis=-1, initial=0))
    e = e8m0_from_float(_f32.mul(bamax, np.float32(1.0 / fmt.max_value)))
    q = _f32.convert(_f32.mul(blocks, _inverse_scale(e)[..., None]), _target(fmt))
    return q.reshape(y.shape), e


def dequantize(data, scale_codes, fmt: MXFP8, out_dtype=jnp.float32):
    """data (float8 [..., n]) + E8M0 codes [..., n/32] -> float32 [..., n]: float(q) * 2**(e-127), saturated to
    +-M (the largest finite value of `out_dtype`) where it exceeds M but the code's rounding interval reaches into
    the output's range (docs/numerics.md section 2, Dequantize). Round the result with `codes.output(., out_dtype)`.

    The E8M0 scale rounds up (TE's `float_to_e8m0`), so a value at the top of the range can take a code past it
    (bf16 max -> E4M3 256 * 2**120 = 2**128, whose lower rounding boundary 248 * 2**120 is below bf16 max): such
    codes decode to +-M, not inf. A code whose interval lies wholly beyond M (an inf in x: scale 0xFE, code
    +-max_norm; an f32 tensor decoded to f16) decodes to +-inf as TE's does; NaN codes and the scale 0xFF give NaN.
    """
    bs = fmt.block_size
    blocked = (*data.shape[:-1], data.shape[-1] // bs, bs)
    s = codes.e8m0_value(scale_codes)[..., None]
    q = codes.small_float_value(data)
    v = _f32.mul(q.reshape(blocked), s).reshape(data.shape)
    # the smallest magnitude that rounds to |q|: the midpoint to the next smaller code (exact in fp32)
    mag = codes.from_dtype(data) & U32(0x7F)
    below = codes.small_float_value(codes.to_dtype(jnp.maximum(mag, U32(1)) - U32(1), data.dtype))
    mid = (jnp.abs(q) + below) * np.float32(0.5)
    reach = _f32.bits(_f32.mul(mid.reshape(blocked), s)).reshape(data.shape) <= codes.OUT_MAX_BITS[
        jnp.dtype(out_dtype)]
    return codes.saturate(v, ~jnp.isinf(q) & reach, out_dtype)
