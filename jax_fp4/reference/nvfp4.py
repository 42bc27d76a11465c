"""NVFP4 quantize / dequantize, bit-exact to docs/numerics.md section 1 (TE `core_nvfp4.cuh`, `dequantize_nvfp4.cuh`).

All functions take the data already oriented with the block axis last (see `jax_fp4.formats`); `quantize` and
`dequantize` in `jax_fp4.reference` do the orientation. Every product that can meet a subnormal goes through the
exact integer routines of `_f32`, so results are the IEEE (CUDA) ones on every platform.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp4.formats import NVFP4
from jax_fp4.reference import _f32, codes, nvfp4_4over6, rht, sr
from jax_fp4.reference.amax import abs_bits

F32 = jnp.float32
FP4_MAX, E4M3_MAX = 6.0, 448.0
ENC_NUMERATOR = np.float32(FP4_MAX * E4M3_MAX)  # 2688
INV_FP4_MAX = np.float32(1.0 / FP4_MAX)  # fp32(1/6)
INV_ENC_NUMERATOR = np.float32(1.0 / (FP4_MAX * E4M3_MAX))  # fp32(1/2688)
WINDOW_FLOOR = np.float32(1e-12)
# fp32(2688 / FLT_MAX) = 7.899323e-36 (0x05280001): below it S_enc = min(2688 / amax, FLT_MAX) is clamped, so the
# decode takes max(amax, DECODE_AMAX_FLOOR), the amax whose 2688 / amax is the clamped S_enc (see decode_scale).
DECODE_AMAX_FLOOR = np.float32(ENC_NUMERATOR / _f32.FLT_MAX)


class NVFP4Parts(NamedTuple):
    codes: jnp.ndarray  # uint32 E2M1 codes [..., n]
    scale_codes: jnp.ndarray  # uint32 E4M3 codes [..., n/16]
    amax: jnp.ndarray | None  # f32 scalar (tensor scale), None for 1x64
    window_amax: jnp.ndarray | None  # f32 [..., n/64] for 1x64


def _block_amax(y, size):
    """fmax|y| over consecutive `size`-element blocks of the last axis -> f32 [..., n/size]."""
    b = abs_bits(y).reshape(*y.shape[:-1], y.shape[-1] // size, size)
    return _f32.from_bits(jnp.max(b, axis=-1, initial=0))


def global_encode_scale(amax, e4m3_max: int = 448):
    """S_enc = min(6 * e4m3_max / amax, FLT_MAX) (2688 / amax, or 1536 / amax on the 4over6 bound 256); 1 where
    amax == 0 or S_enc == 0 (amax = inf). fp32.

    The result passes an optimization barrier: without it XLA:CPU (jax 0.12) may fuse the exact integer division into
    every element's encode, and inside a `lax.scan` body it then spent over 20 minutes compiling one NVFP4 quantize
    (tests/test_quantize_ops.py, 3.5 s with jax 0.10.2). The barrier changes no value.
    """
    amax = jnp.asarray(amax, F32)
    s = _f32.min_flt_max(_f32.div(np.float32(FP4_MAX * e4m3_max), amax))
    return lax.optimization_barrier(jnp.where(_f32.is_zero(amax) | _f32.is_zero(s), F32(1), s))


def _e4m3(v):
    return _f32.convert(v, _f32.E4M3)


def _e4m3_value(c):
    return codes.small_float_value(codes.to_dtype(c, jnp.float8_e4m3fn))


def encode_blocks(blocks, bamax, s_enc, rbytes=None):
    """The 1x16 block step shared by single-tensor and grouped quantize.

    blocks: f32 [..., nb, 16]; bamax: f32 [..., nb] block (or 2D tile) amax; s_enc: f32 encode scale broadcastable
    to bamax (the tensor's S_enc, or each block's group's); rbytes: uint32 [..., nb, 16] random bytes for
    stochastic rounding, or None for RNE. Returns (E2M1 codes [..., nb, 16], E4M3 scale codes [..., nb]), uint32:
    s_b = e4m3(bamax * (S_enc * fp32(1/6))); e_b = min(1 / (s_b * S_dec), FLT_MAX); q = e2m1(x * e_b).
    """
    s_enc = jnp.asarray(s_enc, F32)
    sc = _e4m3(_f32.mul(bamax, s_enc * INV_FP4_MAX))
    e_b = _f32.min_flt_max(_f32.recip(_f32.mul(_e4m3_value(sc), _f32.recip(s_enc))))
    v = _f32.mul(blocks, e_b[..., None])
    q = _f32.convert(v, _f32.E2M1) if rbytes is None else sr.round_e2m1(v, rbytes)
    return q, sc


def quantize(y, fmt: NVFP4, key=None) -> NVFP4Parts:
    """Quantize y [..., n] (block axis last, n % 16 == 0; bf16/f16/f32) to NVFP4 (1D, 2D, RHT, SR or 1x64)."""
    y = prepare(y, fmt)
    if fmt.local_1x64:
        return quantize_1x64(y)
    words = sr.philox_key(key) if fmt.stochastic_rounding else None
    return quantize_with_amax(y, fmt, _f32.from_bits(jnp.max(abs_bits(y), initial=0)), words)


def prepare(y, fmt: NVFP4):
    """Widen to float32 and apply the RHT when the format asks for it (block axis last)."""
    y = _f32.widen(y)  # exact (subnormals kept on every platform)
    return rht.forward(y) if fmt.rht else y


def quantize_with_amax(y, fmt: NVFP4, amax, key_words=None) -> NVFP4Parts:
    """The 1D/2D quantize of an already prepared y (float32, RHT applied) with a given tensor amax.

    amax: float32 broadcastable to y.shape[:-1] + (1,) (a scalar, or one per leading batch entry);
    key_words: uint32[2] Philox key for stochastic rounding (`sr.philox_key`), or uint32[2 + 2 * y.ndim], the
      stream words of a shard of a larger tensor (`sr.shard_words`: its bytes are the global tensor's); else None
      (RNE).
    """
    bs = fmt.block_size
    amax = jnp.asarray(amax, F32)
    bamax = _block_amax(y, bs)  # [..., n/16]
    if fmt.scaling_2d:
        bamax = _tile_amax_2d(bamax, fmt.tile_2d)
    blocks = y.reshape(*y.shape[:-1], y.shape[-1] // bs, bs)
    s_enc = global_encode_scale(amax, fmt.global_e4m3_max)
    if fmt.use_4over6:
        q, sc = nvfp4_4over6.encode_blocks(blocks, bamax, amax, s_enc, fmt.global_e4m3_max, fmt.err_mode_4over6,
                                           fmt.tile_2d if fmt.scaling_2d else None)
        return NVFP4Parts(q.reshape(y.shape), sc, amax, None)
    rbytes = None if key_words is None else sr.random_bytes_from_words(key_words, y.shape).reshape(blocks.shape)
    q, sc = encode_blocks(blocks, bamax, s_enc, rbytes)
    return NVFP4Parts(q.reshape(y.shape), sc, amax, None)


def _tile_amax_2d(bamax, tile):
    """Per-16x16-tile amax broadcast back to every row of the tile: bamax [..., n/16] -> same shape."""
    shape = bamax.shape
    rows = math.prod(shape[:-1])
    m = bamax.reshape(rows // tile, tile, shape[-1])  # rows flattened, grouped in 16s
    t = _f32.from_bits(jnp.max(_f32.bits(m), axis=1, keepdims=True))
    return jnp.broadcast_to(t, m.shape).reshape(shape)


def quantize_1x64(y) -> NVFP4Parts:
    """1x64 local encode of a float32 y [..., n] (n % 64 == 0): codes, scales and window amax [..., n/64]."""
    bs, w = NVFP4.block_size, NVFP4.window_size
    wamax = _block_amax(y, w)  # [..., n/64]
    s_enc_w = _f32.min_flt_max(_f32.div(ENC_NUMERATOR, jnp.maximum(wamax, WINDOW_FLOOR)))
    s_enc_w = jnp.where(_f32.is_zero(wamax), F32(1), s_enc_w)
    # Per 1x16 block. The barrier keeps XLA's algebraic simplifier from pushing this broadcast through the integer
    # division chains below, where jax >= 0.11 loops for minutes at compile time.
    s_enc_b = lax.optimization_barrier(jnp.repeat(s_enc_w, w // bs, axis=-1))
    sc = _e4m3(_f32.mul(_block_amax(y, bs), s_enc_b * INV_FP4_MAX))
    s_b = _e4m3_value(sc)
    block_scale = jnp.where(_f32.is_zero(s_b), F32(0), _f32.div(s_enc_b, s_b))
    blocks = y.reshape(*y.shape[:-1], y.shape[-1] // bs, bs)
    q = _f32.convert(_f32.mul(blocks, block_scale[..., None]), _f32.E2M1).reshape(y.shape)
    return NVFP4Parts(q, sc, None, wamax)


def window_nan(x, axis: int):
    """bool [..., n/64]: which 1x64 windows of x (block axis `axis`, n = x.shape[axis], stored orientation: the
    block axis moved last) hold a NaN. The window amax ignores NaNs (fmax) and E2M1 has no NaN, so a 1x64 tensor
    would lose a NaN of x; `quantize` encodes with the finite window amax and carries NaN in place of the window
    amax of such a window, which then dequantizes (and multiplies) to NaN (docs/numerics.md section 6)."""
    y = jnp.isnan(jnp.moveaxis(jnp.asarray(x), axis, -1))
    return jnp.any(y.reshape(*y.shape[:-1], y.shape[-1] // NVFP4.window_size, NVFP4.window_size), axis=-1)


def _decode_amax_floor(e4m3_max):
    return DECODE_AMAX_FLOOR if e4m3_max == 448 else np.float32(np.float32(FP4_MAX * e4m3_max) / _f32.FLT_MAX)


def _inv_enc_numerator(e4m3_max):
    """fp32(1 / (6 * e4m3_max)): fp32(1/2688), or fp32(1/1536) on the 4over6 bound (TE dequantize_nvfp4.cuh
    `factor_inv`)."""
    return np.float32(1.0 / (FP4_MAX * e4m3_max))


def decode_amax(amax, e4m3_max: int = 448):
    """The tensor amax the decode uses: max(amax, fp32(2688 / FLT_MAX)) for amax > 0 (0 and NaN stay); on the
    4over6 bound (e4m3_max = 256) the floor is fp32(1536 / FLT_MAX).

    Below 7.9e-36 the encode clamps S_enc = 2688 / amax at FLT_MAX; decoding with the clamped S_enc, i.e. with the
    amax 2688 / FLT_MAX, keeps quantize and dequantize consistent there (TE decodes with amax / 2688 and is off by
    DECODE_AMAX_FLOOR / amax, e.g. x80 at amax = 1e-37). Unchanged for amax >= 7.9e-36 and for amax = 0 (an
    all-zero tensor: every block scale is 0).
    """
    amax = jnp.asarray(amax, F32)
    b = _f32.bits(amax)  # on the bits: a subnormal amax is not flushed to 0 by XLA:CPU
    floor = _decode_amax_floor(e4m3_max)
    small = (b != jnp.uint32(0)) & (b < _f32.bits(floor))
    return jnp.where(small, floor, amax)


def tensor_decode_scale(amax, e4m3_max: int = 448):
    """float32 decode_amax(amax) * fp32(1/2688) (fp32(1/1536) on the 4over6 bound 256, `NVFP4.global_e4m3_max`):
    the tensor scale of the GEMM emulation (block scales apart)."""
    return decode_amax(amax, e4m3_max) * _inv_enc_numerator(e4m3_max)


def decode_scale(s_b, amax, e4m3_max: int = 448):
    """The 1D/2D/RHT decode multiplier of a block: f = (s_b * A) * fp32(1/2688), A = decode_amax(amax) (TE's
    association), or s_b * (A * fp32(1/2688)) where s_b * A overflows fp32 (amax > FLT_MAX / 448 = 7.6e35; TE's
    association gives inf there). Exact products (`_f32.mul`), so subnormal factors are kept on every platform."""
    a = decode_amax(amax, e4m3_max)
    inv = _inv_enc_numerator(e4m3_max)
    p = _f32.mul(s_b, a)
    inf = (_f32.bits(p) & jnp.uint32(0x7FFFFFFF)) == jnp.uint32(0x7F800000)
    return jnp.where(inf, _f32.mul(s_b, _f32.mul(a, inv)), _f32.mul(p, inv))


def dequantize(q_codes, scale_codes, amax, window_amax, fmt: NVFP4, inverse_rht: bool = True):
    """NVFP4 codes [..., n] + E4M3 scale codes [..., n/16] -> float32 values [..., n] (block axis last).

    1D/2D: x = value(q) * decode_scale(s_b, amax) (TE's (s_b * amax) * fp32(1/2688) for amax in [7.9e-36, 7.6e35]);
    1x64: x = (value(q) * s_b) / S_enc,w (NaN for a NaN window amax); RHT: then @ H.T (inverse_rht=False: the values
    stay in the transformed domain).
    """
    bs = fmt.block_size
    v = codes.e2m1_value(q_codes).reshape(*q_codes.shape[:-1], q_codes.shape[-1] // bs, bs)
    s_b = _e4m3_value(scale_codes)
    if fmt.local_1x64:  # a NaN window amax (a window that held a NaN, `window_nan`) decodes its window to NaN
        s_enc_w = _f32.min_flt_max(_f32.div(ENC_NUMERATOR, jnp.maximum(window_amax, WINDOW_FLOOR)))
        s_enc_w = jnp.where(_f32.is_zero(window_amax), F32(1), s_enc_w)
        s_enc_w = jnp.where(jnp.isnan(window_amax), F32(jnp.nan), s_enc_w)
        s_enc_b = lax.optimization_barrier(jnp.repeat(s_enc_w, fmt.window_size // bs, axis=-1))  # see quantize_1x64
        x = _f32.div(_f32.mul(v, s_b[..., None]), s_enc_b[..., None])
    else:
        f = decode_scale(s_b, amax, fmt.global_e4m3_max)
        x = _f32.mul(v, f[..., None])
    x = x.reshape(q_codes.shape)
    return rht.inverse(x) if fmt.rht and inverse_rht else x
