"""Format codes <-> JAX arrays, and code -> value tables (docs/numerics.md sections 1-2).

Codes are carried as uint32 inside the reference and stored in the formats' own dtypes:
float4_e2m1fn (E2M1 data), float8_e4m3fn / float8_e5m2 (MXFP8 data, NVFP4 scales), float8_e8m0fnu (MX scales).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp4.reference import _f32

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def to_dtype(codes, dtype):
    """uint32 codes -> array of `dtype` with those bit patterns (4- or 8-bit formats)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and dtype.name.startswith("float4"):
        return lax.bitcast_convert_type(codes.astype(jnp.uint4), dtype)
    return lax.bitcast_convert_type(codes.astype(jnp.uint8), dtype)


def from_dtype(a) -> jnp.ndarray:
    """Array of a 4- or 8-bit format -> its codes as uint32."""
    if jnp.dtype(a.dtype).name.startswith("float4"):
        return lax.bitcast_convert_type(a, jnp.uint4).astype(jnp.uint32)
    return lax.bitcast_convert_type(a, jnp.uint8).astype(jnp.uint32)


def e2m1_value(codes) -> jnp.ndarray:
    """E2M1 codes (uint32, sign in bit 3) -> float32 values (code 8 is -0.0)."""
    mag = jnp.asarray(E2M1_VALUES)[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -mag, mag)


def small_float_value(a) -> jnp.ndarray:
    """float8_e4m3fn / float8_e5m2 array -> exact float32 values (their subnormals are fp32 normals)."""
    return a.astype(jnp.float32)


def e8m0_value(codes) -> jnp.ndarray:
    """E8M0 codes -> float32 2**(e-127); code 0 is the fp32 subnormal 2**-127, code 255 is NaN."""
    b = jnp.where(codes == 0, jnp.uint32(0x00400000), codes << 23)
    return _f32.from_bits(jnp.where(codes == 255, jnp.uint32(0x7FC00000), b))


#: fp32 bit pattern of the largest finite value of each output dtype (FLT_MAX, bf16 0x7F7F, f16 65504).
OUT_MAX_BITS = {jnp.dtype(jnp.float32): 0x7F7FFFFF, jnp.dtype(jnp.bfloat16): 0x7F7F0000,
                jnp.dtype(jnp.float16): 0x477FE000}


def saturate(values_f32, where, dtype):
    """values_f32 with the entries whose magnitude exceeds the output dtype's largest finite value M (an fp32
    overflow to inf included) replaced by +-M where `where` (bool, broadcastable) holds; NaN untouched. On the bits,
    so subnormals are not flushed. `output(.., dtype)` then rounds those entries to +-M (the MXFP8 decode rule of
    docs/numerics.md section 2, `mxfp8.dequantize`)."""
    m = jnp.uint32(OUT_MAX_BITS[jnp.dtype(dtype)])
    b = _f32.bits(values_f32)
    mag = b & jnp.uint32(0x7FFFFFFF)
    over = (mag > m) & (mag <= jnp.uint32(0x7F800000)) & where
    return jnp.where(over, _f32.from_bits((b & jnp.uint32(0x80000000)) | m), values_f32)


def output(values_f32, dtype):
    """Round float32 values to the output dtype (f32/bf16/f16), RNE, NaN canonical (bit-exact contract)."""
    dtype = jnp.dtype(dtype)
    target = {jnp.dtype(jnp.float32): _f32.F32, jnp.dtype(jnp.bfloat16): _f32.BF16,
              jnp.dtype(jnp.float16): _f32.F16}.get(dtype)
    if target is None:
        raise ValueError(f"dequantize: output dtype must be float32, bfloat16 or float16, got {dtype}")
    c = _f32.convert(values_f32, target)
    if target is _f32.F32:
        return _f32.from_bits(c)
    return lax.bitcast_convert_type(c.astype(jnp.uint16), dtype)
