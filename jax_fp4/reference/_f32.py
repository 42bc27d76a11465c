"""Exact IEEE-754 arithmetic on fp32 bit patterns, independent of the platform's denormal mode.

XLA:CPU runs fp32 arithmetic with flush-to-zero / denormals-are-zero, while the CUDA kernels keep subnormals.
docs/numerics.md asks for IEEE results (RNE, subnormals kept) in the scale computations, so the reference does every
product that can meet a subnormal operand or result with the integer routines below. They work on uint32 bit
patterns only (no 64-bit types, so they run without `jax_enable_x64`), are elementwise and jittable.

`encode` is the one rounding routine for every target format (fp32, bf16, f16, E4M3, E5M2, E2M1): it rounds a
value given as `significand * 2**exponent` (plus a sticky bit) to the nearest representable value, ties to even,
with gradual underflow, then saturates (satfinite formats) or overflows to inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

U32 = jnp.uint32
I32 = jnp.int32
FLT_MAX = np.float32(np.finfo(np.float32).max)


def bits(x) -> jnp.ndarray:
    """uint32 bit pattern of float32(x) (bf16/f16 inputs are widened exactly first, see `widen_bits`)."""
    return widen_bits(x)


def widen_bits(x) -> jnp.ndarray:
    """uint32 fp32 bit pattern of a bfloat16 / float16 / float32 array, widened exactly with integer operations.

    docs/numerics.md and the kernels keep subnormals, while XLA:CPU has been seen to drop bfloat16 subnormals (its
    bfloat16 gather in the grouped reference, jax 0.11.2 / 0.12; see `grouped._take`). The widening itself is done
    without float operations so that it cannot depend on the platform's denormal mode either: bfloat16 is the upper
    half of a float32, and float16 subnormals are fp32 normals. Other dtypes go through `astype(float32)`.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(U32) << 16
    if x.dtype == jnp.float16:
        h = lax.bitcast_convert_type(x, jnp.uint16).astype(U32)
        sign, e, m = (h >> 15) << 31, (h >> 10) & U32(0x1F), h & U32(0x3FF)
        p = 31 - _clz(m)  # highest set bit of a subnormal's significand (0..9): value m * 2**-24
        sub = jnp.where(m == 0, U32(0), ((p + 103).astype(U32) << 23) | ((m << (23 - p).astype(U32)) & U32(0x7FFFFF)))
        mag = jnp.where(e == 0x1F, U32(0x7F800000) | (m << 13), ((e + 112) << 23) | (m << 13))
        return sign | jnp.where(e == 0, sub, mag)
    return lax.bitcast_convert_type(x.astype(jnp.float32), U32)


def widen(x) -> jnp.ndarray:
    """float32 of a bfloat16 / float16 / float32 array, exact (subnormals kept on every platform): `widen_bits`."""
    return from_bits(widen_bits(x))


def from_bits(b) -> jnp.ndarray:
    return lax.bitcast_convert_type(jnp.asarray(b).astype(U32), jnp.float32)


class Target(NamedTuple):
    """A binary floating-point target: mantissa bits, exponent bias, largest finite code, overflow code, NaN code."""

    mbits: int
    bias: int
    max_code: int  # largest finite magnitude code
    overflow_code: int  # code for overflow (inf, or max_code for satfinite formats)
    nan_code: int  # canonical NaN (for E2M1, which has none: the satfinite result +6)


F32 = Target(23, 127, 0x7F7FFFFF, 0x7F800000, 0x7FC00000)
BF16 = Target(7, 127, 0x7F7F, 0x7F80, 0x7FC0)
F16 = Target(10, 15, 0x7BFF, 0x7C00, 0x7E00)
E4M3 = Target(3, 7, 0x7E, 0x7E, 0x7F)  # satfinite: overflow and inf saturate to 448
E5M2 = Target(2, 15, 0x7B, 0x7B, 0x7F)  # satfinite: overflow and inf saturate to 57344
E2M1 = Target(1, 1, 0x7, 0x7, 0x7)  # satfinite; NaN -> +6


def _clz(x):
    return lax.clz(x).astype(I32)


def _unpack(b):
    """Split fp32 bits into (sign, exponent e, 24-bit significand m) with |value| = m * 2**(e - 23).

    m has bit 23 set for every nonzero finite value (subnormals are normalised); zero gives m = 0.
    """
    sign = b >> 31
    ef = ((b >> 23) & 0xFF).astype(I32)
    frac = b & U32(0x7FFFFF)
    # Subnormal: highest set bit p of frac, value = frac * 2**-149 = (frac << (23 - p)) * 2**(p - 149 - 23).
    p = 31 - _clz(frac)
    sub_shift = jnp.clip(23 - p, 0, 31).astype(U32)
    m = jnp.where(ef == 0, frac << sub_shift, frac | U32(1 << 23))
    e = jnp.where(ef == 0, p - 149, ef - 127)
    return sign, e, m


def _rne_shift(sig, sticky, t):
    """Round sig * 2**-t to an integer, ties to even; `sticky` marks nonzero bits already below sig."""
    t = jnp.maximum(t, 0)
    tc = jnp.minimum(t, 31).astype(U32)
    q = sig >> tc
    rem = sig & ((U32(1) << tc) - U32(1))
    half = jnp.where(tc > 0, U32(1) << (jnp.maximum(tc, 1) - U32(1)), U32(0))
    up = (tc > 0) & ((rem > half) | ((rem == half) & (sticky | ((q & 1) == 1))))
    q = q + up.astype(U32)
    # t == 32: q = 0; round up iff sig > 2**31, or == 2**31 with sticky. t > 32: 0.
    up32 = (sig > U32(1 << 31)) | ((sig == U32(1 << 31)) & sticky)
    q = jnp.where(t == 32, up32.astype(U32), q)
    return jnp.where(t > 32, U32(0), q)


def encode(sign, sig, sticky, exp2, target: Target):
    """Round (-1)**sign * (sig + sticky*eps) * 2**exp2 to `target`, RNE with gradual underflow.

    sig: uint32 significand (may be 0), sticky: bool, exp2: int32. Returns the target's code as uint32
    (sign included). Handles finite values only; callers patch inf / NaN.
    """
    top = 31 - _clz(sig)  # position of the leading one
    e = top + exp2  # value in [2**e, 2**(e+1))
    emin = 1 - target.bias
    t = top - target.mbits + jnp.maximum(emin - e, 0)
    q = _rne_shift(sig, sticky, t)
    code = jnp.where(e >= emin, ((jnp.maximum(e - emin, 0)).astype(U32) << target.mbits) + q, q)
    code = jnp.where(code > U32(target.max_code), U32(target.overflow_code), code)
    code = jnp.where(sig == 0, U32(0), code)
    return code | (sign.astype(U32) << (_nbits(target) - 1))


def _nbits(target: Target) -> int:
    return {F32: 32, BF16: 16, F16: 16, E4M3: 8, E5M2: 8, E2M1: 4}[target]


def convert(x, target: Target):
    """Round fp32 values (given as float or bits) to `target`; returns codes as uint32.

    Infinities overflow (inf for F32/BF16/F16, the largest finite value for the satfinite formats). NaN becomes
    the target's canonical NaN (+6 for E2M1). For F32 this is the identity on non-NaN values.
    """
    b = bits(x)
    sign, e, m = _unpack(b)
    code = encode(sign, m, jnp.zeros(m.shape, bool), e - 23, target)
    mag = b & U32(0x7FFFFFFF)
    code = jnp.where(mag == U32(0x7F800000), U32(target.overflow_code) | (sign << (_nbits(target) - 1)), code)
    return jnp.where(mag > U32(0x7F800000), U32(target.nan_code), code)


def mul(a, b):
    """Correctly rounded fp32 product a*b (RNE, subnormal operands and results kept); returns float32."""
    ba, bb = bits(a), bits(b)
    sa, ea, ma = _unpack(ba)
    sb, eb, mb = _unpack(bb)
    ah, al = ma >> 12, ma & U32(0xFFF)
    bh, bl = mb >> 12, mb & U32(0xFFF)
    hh, mid, ll = ah * bh, ah * bl + al * bh, al * bl
    lo = ll + ((mid & U32(0xFFF)) << 12)
    hi = hh + (mid >> 12) + (lo >> 24)
    lo = lo & U32(0xFFFFFF)
    sig = (hi << 8) | (lo >> 16)  # product >> 16
    sticky = (lo & U32(0xFFFF)) != 0
    sign = sa ^ sb
    code = encode(sign, sig, sticky, ea + eb - 30, F32)
    return from_bits(_patch_specials(code, ba, bb, sign))


def div(a, b):
    """Correctly rounded fp32 quotient a/b (RNE, subnormal operands and results kept); returns float32.

    XLA:GPU does not promise IEEE division for fp32 `/`, XLA:CPU flushes subnormals: this is exact on both.
    """
    ba, bb = bits(a), bits(b)
    sa, ea, ma = _unpack(ba)
    sb, eb, mb = _unpack(bb)
    # Restoring long division of the significands: q = floor(ma * 2**26 / mb), 26-27 significant bits.
    safe_m = jnp.maximum(mb, U32(1))
    r = ma
    q = (r >= safe_m).astype(U32)
    r = r - safe_m * q
    for _ in range(26):
        r = r << 1
        bit = r >= safe_m
        r = r - jnp.where(bit, safe_m, U32(0))
        q = (q << 1) | bit.astype(U32)
    sign = sa ^ sb
    code = encode(sign, q, r != 0, ea - eb - 26, F32)
    mag_a, mag_b = ba & U32(0x7FFFFFFF), bb & U32(0x7FFFFFFF)
    inf, sign_bit = U32(0x7F800000), sign << 31
    code = jnp.where((mag_a == 0) | (mag_b == inf), sign_bit, code)  # 0/x, x/inf -> +-0
    code = jnp.where((mag_b == 0) | (mag_a == inf), inf | sign_bit, code)  # x/0, inf/x -> +-inf
    nan = (mag_a > inf) | (mag_b > inf) | ((mag_a == 0) & (mag_b == 0)) | ((mag_a == inf) & (mag_b == inf))
    return from_bits(jnp.where(nan, U32(0x7FC00000), code))


def recip(a):
    """Correctly rounded fp32 reciprocal 1/a (RNE, subnormal operands and results kept); returns float32."""
    return div(jnp.ones(jnp.shape(a), jnp.float32), a)


def _patch_specials(code, ba, bb, sign):
    ma, mb = ba & U32(0x7FFFFFFF), bb & U32(0x7FFFFFFF)
    inf = U32(0x7F800000)
    sign_bit = sign << 31
    is_zero = (ma == 0) | (mb == 0)
    is_inf = (ma == inf) | (mb == inf)
    code = jnp.where(is_zero, sign_bit, code)
    code = jnp.where(is_inf, inf | sign_bit, code)
    nan = (ma > inf) | (mb > inf) | (is_zero & is_inf)
    return jnp.where(nan, U32(0x7FC00000), code)


def min_flt_max(v):
    """min(v, FLT_MAX) for v >= 0 or +inf, on the bits (a subnormal v is untouched by DAZ)."""
    return jnp.where(bits(v) > bits(FLT_MAX), FLT_MAX, v)


def is_zero(x):
    """|x| == 0 on the bit pattern (a subnormal is not zero, whatever the platform's denormal mode)."""
    return (bits(x) & U32(0x7FFFFFFF)) == 0


def flush_subnormal(x):
    """Flush fp32 subnormals to signed zero (explicit FTZ; the same on every platform)."""
    b = bits(x)
    sub = ((b & U32(0x7F800000)) == 0) & ((b & U32(0x7FFFFF)) != 0)
    return from_bits(jnp.where(sub, b & U32(0x80000000), b))


_ADD_SMALL = np.uint32(0x0D800000)  # 2^-100: below it both addends are scaled into the normal range first; numpy:
# no device array at import (jax.distributed.initialize must come before the backend starts)
_TWO_64, _TWO_M64 = np.float32(2.0**64), np.float32(2.0**-64)


def add(a, b):
    """Correctly rounded fp32 sum a+b (RNE, subnormal operands and results kept); returns float32.

    When max(|a|, |b|) >= 2^-100 the platform's fp32 add is exact IEEE even under DAZ / FTZ: a subnormal addend is
    below half an ulp of the other operand (so RN ignores it), and a cancellation leaves a multiple of at least 2^-124,
    a normal number. Below 2^-100 both addends are multiples of 2^-149: scaled by 2^64 (exact, `mul`) they are
    normals, their rounded sum is RN(a + b) * 2^64 (an exact sum in the subnormal range has at most 23 significant
    bits), and the exact `mul` by 2^-64 brings it back, subnormal or not.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    ma, mb = bits(a) & U32(0x7FFFFFFF), bits(b) & U32(0x7FFFFFFF)
    small = jnp.maximum(ma, mb) < _ADD_SMALL
    scaled = mul(mul(a, _TWO_64) + mul(b, _TWO_64), _TWO_M64)
    return jnp.where(small, scaled, a + b)


def neg(x):
    """-x on the bit pattern (exact for subnormals and NaN payloads)."""
    return from_bits(bits(x) ^ U32(0x80000000))


def abs_(x):
    """|x| on the bit pattern (exact for subnormals)."""
    return from_bits(bits(x) & U32(0x7FFFFFFF))
