"""An independent numpy model of TE's NVFP4 4over6 quantize, the oracle of the 4over6 tests.

Transcribed from TransformerEngine's PyTorch reference quantizer
(`transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`: `_quantize_blockwise_reference` and
`_quantize_blockwise_4over6_reference`, `_sum_4over6_2d_error`) in numpy float32, whose scalar and array arithmetic
is IEEE fp32 with RNE and subnormals kept; E4M3 / E2M1 roundings through ml_dtypes (RNE) after TE's clamps. Two
points follow TE's CUDA kernel (`quantize_4over6_nvfp4.cuh`) where the PyTorch reference differs from it: S_enc = 1
for amax = 0 (`compute_global_encode_scaling_factor_FP4`; the reference keeps FLT_MAX there, which changes no code of
an all-zero tensor), and NaN inputs encode as +6 (the satfinite E2M1 convert; docs/numerics.md section 1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _e4m3(v):
    """E4M3 codes (uint8) of clamp(v, -448, 448), RNE."""
    return np.clip(v, F32(-448), F32(448)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e4m3_value(c):
    return c.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e2m1(v):
    """E2M1 codes (uint8, sign in bit 3) of clamp(v, -6, 6), RNE; NaN -> +6 (code 7)."""
    c = np.clip(np.nan_to_num(v, nan=6.0), F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return c


def _e2m1_value(c):
    return (c.astype(np.uint8)).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def global_encode_scale(amax, e4m3_max):
    with np.errstate(divide="ignore", over="ignore"):
        s = np.minimum(F32(6 * e4m3_max) / F32(amax), FLT_MAX).astype(np.float32)
    return F32(1) if (amax == 0 or s == 0) else F32(s)


def quantize_4over6(x, amax=None, *, e4m3_max=256, err_mode="MAE", two_d=False, with_pick=False):
    """x: float32 [m, n] (n % 16 == 0; m % 16 == 0 with two_d). Returns (E2M1 codes uint8 [m, n], E4M3 scale codes
    uint8 [m, n/16], amax float32), and with_pick the bool [m, n/16] of the blocks that kept map-to-4. amax: the
    tensor amax (default max |x| ignoring NaN)."""
    x = np.asarray(x, np.float32)
    m, n = x.shape
    nb = n // 16
    if amax is None:
        amax = F32(np.nanmax(np.abs(x))) if x.size and not np.all(np.isnan(x)) else F32(0)
    amax = F32(amax)
    xb = x.reshape(m, nb, 16)
    with np.errstate(invalid="ignore"):
        vec_max = np.fmax.reduce(np.abs(xb), axis=-1, initial=F32(0)).astype(np.float32)  # NaN ignored (fmaxf)
    if two_d:
        t = vec_max.reshape(m // 16, 16, nb).max(axis=1)
        vec_max = np.repeat(t, 16, axis=0)
    s_enc = global_encode_scale(amax, e4m3_max)
    s_dec = F32(F32(1) / s_enc)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        base = (vec_max / F32(6)).astype(np.float32) * s_enc
        cands = []
        for sc in (_e4m3(base * F32(1.5)), _e4m3(base)):
            s_b = _e4m3_value(sc)
            enc = np.minimum(F32(1) / (s_b * s_dec), FLT_MAX).astype(np.float32)
            q = _e2m1(xb * enc[..., None])
            fp4 = _e2m1_value(q)
            err = np.zeros((m, nb), np.float32)
            denom = F32(6) * F32(e4m3_max)
            for i in range(16):
                val = ((fp4[:, :, i] * s_b) * amax) / denom
                d = val - xb[:, :, i]
                err = err + (np.abs(d) if err_mode == "MAE" else d * d)
            if two_d:
                r = err.reshape(m // 16, 16, nb)
                r = r[:, 0:8] + r[:, 8:16]
                r = r[:, 0:4] + r[:, 4:8]
                r = r[:, 0:2] + r[:, 2:4]
                err = np.repeat(r[:, 0] + r[:, 1], 16, axis=0)
            cands.append((q, sc, err))
    (q4, sc4, e4), (q6, sc6, e6) = cands
    pick4 = e4 < e6
    q = np.where(pick4[..., None], q4, q6).reshape(m, n)
    out = q.astype(np.uint8), np.where(pick4, sc4, sc6).astype(np.uint8), amax
    return (*out, pick4) if with_pick else out


def dequantize(q, sc, amax, e4m3_max=256):
    """TE `dequantize_nvfp4.cuh`: value(q) * ((s_b * A) * fp32(1 / (6 * e4m3_max))), float32 [m, n], with jax_fp4's
    documented floor A = max(amax, fp32(6 * e4m3_max / FLT_MAX)) for amax > 0 (docs/numerics.md section 1,
    Dequantize; TE takes A = amax) and amax < FLT_MAX / 448 (the overflow-safe association is not modelled)."""
    m, n = q.shape
    floor = F32(F32(6 * e4m3_max) / FLT_MAX)
    a = floor if 0 < F32(amax) < floor else F32(amax)
    f = (_e4m3_value(sc) * a) * F32(1.0 / (6.0 * e4m3_max))
    return (_e2m1_value(q).reshape(m, n // 16, 16) * f[..., None]).reshape(m, n)
