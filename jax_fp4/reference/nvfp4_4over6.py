"""NVFP4 "4over6" block selection (`NVFP4(use_4over6=True)`), bit-exact to TE's 4over6 quantize.

TE: `common/cast/nvfp4/quantize_4over6_nvfp4.cuh` (the kernel, `compute_scale_pair`, `accumulate_dequant_error`,
`quantize_stage_rowwise` / `_colwise`) and `pytorch/custom_recipes/reference_nvfp4.py`
(`_quantize_blockwise_4over6_reference`, `_sum_4over6_2d_error`); docs/numerics.md section 1 states the rules.

Per 1x16 block with block (or 16x16 tile) amax `bamax`, under tensor amax `amax` and E4M3 bound `B` (256 or 448):
  S_enc = min(6B / amax, FLT_MAX) (1 for amax 0 or S_enc 0); base = (bamax / 6) * S_enc (a division, then a product);
  sc6 = e4m3(min(base, 448)); sc4 = e4m3(min(base * 1.5, 448));
  e_c = min(1 / (value(sc_c) * (1 / S_enc)), FLT_MAX); q_c = e2m1_rne_satfinite(x * e_c) for c in {4, 6};
  err_c = sum over the 16 elements, in index order from +0: |((value(q_c) * value(sc_c)) * amax) / (6B) - x|
  (MAE; MSE squares the difference); 2D: the 16 rows' errors of a tile summed as TE's warp tree
  ((e_i + e_{i+8}), then +4, +2, +1 apart); the block keeps (q4, sc4) iff err_4 < err_6 (ties and NaN: map-to-6).
All products, quotients and sums are the IEEE fp32 ones with subnormals kept (`_f32`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp4.reference import _f32, codes

F32 = jnp.float32
_FP4_MAX = np.float32(6.0)
_MAP4_EXPAND = np.float32(1.5)


def encode_blocks(blocks, bamax, amax, s_enc, e4m3_max: int, err_mode: str, tile_2d: int | None):
    """The 4over6 block step: (E2M1 codes [..., nb, 16], E4M3 scale codes [..., nb]), uint32.

    blocks: f32 [..., nb, 16] (block axis last); bamax: f32 [..., nb], each block's amax (with `tile_2d` its 16x16
    tile's); amax: f32 tensor amax broadcastable to bamax (the error's dequantize uses it raw, as TE's kernel does);
    s_enc: f32 S_enc built on `e4m3_max`, broadcastable to bamax; err_mode: "MAE" or "MSE"; tile_2d: 16 for 2D
    scaling (the leading axes flattened are the rows, a multiple of 16) or None.
    """
    amax = jnp.broadcast_to(jnp.asarray(amax, F32), bamax.shape)
    base = _f32.mul(_f32.div(bamax, _FP4_MAX), s_enc)
    s_dec = _f32.recip(s_enc)
    denom = np.float32(6.0 * e4m3_max)
    # Both candidates at once along a leading axis of 2 (map-to-4, map-to-6): one graph, half the compile time.
    sc = jnp.stack([_e4m3(_f32.mul(base, _MAP4_EXPAND)), _e4m3(base)])
    s_b = codes.small_float_value(codes.to_dtype(sc, jnp.float8_e4m3fn))
    e_b = _f32.min_flt_max(_f32.recip(_f32.mul(s_b, s_dec)))
    q = _stage(_f32.convert(_f32.mul(blocks[None], e_b[..., None]), _f32.E2M1))
    val = _stage(_f32.div(_f32.mul(_f32.mul(codes.e2m1_value(q), s_b[..., None]), amax[None, ..., None]), denom))
    diff = _f32.add(val, _f32.neg(blocks[None]))
    e = _stage(_f32.abs_(diff) if err_mode == "MAE" else _f32.mul(diff, diff))
    # TE's order: element 0 first, from +0 (a scan: one add in the compiled loop body instead of 16 in line)
    err, _ = lax.scan(lambda acc, t: (_f32.add(acc, t), None), jnp.zeros(sc.shape, F32), jnp.moveaxis(e, -1, 0))
    if tile_2d is not None:
        err = _tile_sum_2d(err, tile_2d)
    pick4 = _less(err[0], err[1])
    return jnp.where(pick4[..., None], q[0], q[1]), jnp.where(pick4, sc[0], sc[1])


def _stage(x):
    """x, materialised: an optimisation barrier between two chains of `_f32` bit routines (values unchanged).

    Each `_f32` routine reads its operands' bits many times. XLA:CPU of jaxlib 0.11 fuses a chain such as
    convert -> mul -> div -> add into one loop fusion and spends minutes compiling it (274 s for a (96, 48) tensor,
    2.6 s with jaxlib 0.10); cut after each heavy step, every fusion stays small and the compile takes seconds.
    """
    return lax.optimization_barrier(x)


def _tile_sum_2d(err, tile):
    """The 16 rows' errors of each 16x16 tile summed in TE's warp-tree order, broadcast back to every row.

    err: f32 [2, ..., nb] (the two candidates) with the leading axes after the first flattened as rows (a multiple
    of 16)."""
    shape = err.shape
    rows = math.prod(shape[1:-1])
    t = err.reshape(2, rows // tile, tile, shape[-1])
    while t.shape[2] > 1:  # lanes i and i + half: (e_i + e_{i+8}), then 4, 2, 1 apart
        half = t.shape[2] // 2
        t = _f32.add(t[:, :, :half], t[:, :, half:])
    return jnp.broadcast_to(t, (2, rows // tile, tile, shape[-1])).reshape(shape)


def _less(a, b):
    """a < b for non-negative fp32 or NaN, on the bits (a subnormal error is not zero under DAZ); False with a NaN."""
    ba, bb = _f32.bits(a), _f32.bits(b)
    inf = jnp.uint32(0x7F800000)
    return (ba < bb) & (ba <= inf) & (bb <= inf)


def _e4m3(v):
    """e4m3_rne_satfinite(min(v, 448)) of a non-negative v (TE's fminf then the satfinite cast)."""
    return _f32.convert(v, _f32.E4M3)

