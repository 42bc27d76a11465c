"""Grouped (MoE) quantize / dequantize: the pure-jnp, bit-exact reference of docs/numerics.md section 4.

N matrices x_g [M_g, K_g] of one dtype live in one contiguous buffer; group g starts at flat element offset
offsets[g] = sum_{i<g} M_i * K_i and is stored row-major. Four shape representations (TE `common/common.h`):

  SAME_BOTH_DIMS     x [N*M, K], N = num_groups (static); every group is [M, K].
  VARYING_FIRST_DIM  x [sum(M_i), K], first_dims int32[N].
  VARYING_LAST_DIM   x [M, sum(K_i)], last_dims int32[N]. The buffer holds N row-major groups [M, K_i] one after the
                     other (group i starts at M * sum(K_<i)); the 2-D shape is nominal, as in TE.
  VARYING_BOTH_DIMS  x [total] (1-D), first_dims and last_dims int32[N].

The representation follows from which of first_dims / last_dims are given. Sizes may be traced (a router's output):
nothing here copies them to the host or loops over data-dependent sizes, so it is jittable and vmappable.

Contract. For every group g, its slice of `data` ([offsets[g], offsets[g+1])) and of `scale`
([offsets[g] // block, offsets[g+1] // block)) equal, bit for bit, `jax_fp4.reference.quantize(x_g, fmt, axis=axis)`
flattened (NVFP4 axis=0: the quantization of x_g.T, data [K_g, M_g]; MXFP8 axis=0: data [M_g, K_g], scales
[M_g/32, K_g]), and `amax[g]` (NVFP4) equals its amax. Scales are compact, group after group. Buffer positions
past offsets[N] (a buffer larger than the groups, e.g. capacity padding) hold code 0 in data and scale, and
dequantize to 0.

Stochastic rounding. Group g uses the random stream of the single-tensor quantize (`jax_fp4.reference.sr`)
restarted for the group with the key `jax.random.fold_in(key, g)`: element l of the group's (oriented, row-major)
data takes byte l of the Philox stream of that key. So group g equals `quantize(x_g, fmt, axis=axis,
key=jax.random.fold_in(key, g))`.

Sizes. Empty groups (a zero dim) are legal. The groups may fill less than the buffer (sum of sizes <= x.size).
Alignment: each group's block-axis length (K_g rowwise, M_g columnwise) must be a multiple of the block size (16
NVFP4, 32 MXFP8): a block never straddles two rows of a group, so each group's scales are its single-tensor scales.
A static dimension is always checked; sizes given as numpy arrays / Python sequences / concrete (non-traced) jax
arrays are checked too (ValueError naming the group; a concrete jax array is read to the host, which only happens
outside jit), as are negative sizes and groups overrunning the buffer. Traced sizes cannot be checked at trace time;
a misaligned group is *poisoned* instead, on the device, without a host sync: its scale codes are NaN (E4M3 0x7F,
E8M0 0xFF), its MXFP8 data codes NaN (0x7F, e4m3fn and e5m2), its NVFP4 amax NaN, so it dequantizes (and multiplies)
to NaN and the error cannot pass silently. Its E2M1 codes are unspecified (its last, partial block reads on into the
next group's elements; the CUDA kernel reproduces even those codes). The other groups keep the contract, their scales
still at offsets[g] // block (each of their blocks is built from that group's elements; every index is
bounds-checked).
A negative traced size counts as 0; groups overrunning the buffer (traced sizes summing past it) are truncated, with
unspecified values. Offsets are int32 (x.size < 2**31).

dbias (`column_sums`): float32 per-group column sums of the canonical [M_g, K_g] matrices (the bias gradient of
grouped dY), [N, K] for SAME_BOTH_DIMS / VARYING_FIRST_DIM, [sum(K_i)] (group g at sum(K_<g)) for VARYING_LAST_DIM;
an fp32 sum whose order is unspecified (not bit-exact).

Cores. `quantize_groups` / `dequantize_groups` take the materialized dims (int32[N] rows and cols, possibly traced)
and per-group Philox key words (`group_key_words`); they are the default lowerings of the `jf4_grouped_quantize` /
`jf4_grouped_dequantize` primitives. `grouped_quantize` / `grouped_dequantize` validate and call them.

Not supported grouped (ValueError): NVFP4 scaling_2d and local_1x64.

Technique: an "oriented gather". Internally every group is laid out in its oriented order (block axis last) at a
block-aligned internal offset aoff[g] = sum_{i<g} round_up(M_i * K_i, block), so each block of `block`
consecutive internal elements belongs to one group. The per-element source index in x comes from a searchsorted
over the offsets; the per-group tensor amax is a segment_max over the blocks' |x| bit patterns (exact, NaN
ignored); the element math is that of `nvfp4` / `mxfp8`. The internal buffer has round_up(x.size + N*(block-1),
block) elements (room for every group's padding to whole blocks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4.formats import MXFP8, NVFP4, Format
from jax_fp4.reference import _f32, codes, mxfp8, nvfp4, nvfp4_4over6, rht, sr
from jax_fp4.reference.amax import abs_bits
from jax_fp4.validation import (  # the grouped input checks, shared with the ops
    Representation,
    check_format,
    check_static_alignment,
    group_dims,
    normalize_axis,
    static_block_dim,
    validate,
)

__all__ = [
    "GroupedQuantized", "Representation", "check_format", "check_static_alignment", "column_sums", "dequantize_groups",
    "group_dims", "group_key_words", "group_offsets", "grouped_dequantize", "grouped_quantize", "misaligned",
    "normalize_axis", "quantize_groups", "static_block_dim", "validate",
]

I32, U32 = jnp.int32, jnp.uint32


@dataclasses.dataclass(frozen=True)
class GroupedQuantized:
    """Grouped quantize outputs (a pytree: arrays are leaves, the rest is static).

    data: 1-D [x.size], the format's data dtype (float4_e2m1fn / float8_e4m3fn / float8_e5m2): each group's data
      flattened, at offsets[g]. scale: 1-D [x.size // block], float8_e4m3fn / float8_e8m0fnu: each group's compact
      scales, at offsets[g] // block. amax: float32[N] per-group tensor amax (NVFP4), None (MXFP8).
    first_dims, last_dims: int32[N] group dims (always materialized). offsets: int32[N+1] element offsets.
    fmt, axis (-1 rowwise / 0 columnwise), representation, x_shape: static.
    """

    data: jnp.ndarray
    scale: jnp.ndarray
    amax: jnp.ndarray | None
    first_dims: jnp.ndarray
    last_dims: jnp.ndarray
    offsets: jnp.ndarray
    fmt: Format
    axis: int
    representation: Representation
    x_shape: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return self.first_dims.shape[-1]

    @property
    def scale_offsets(self) -> jnp.ndarray:
        """int32[N+1]: where each group's scales start in `scale` (offsets // block size)."""
        return self.offsets // self.fmt.block_size


jax.tree_util.register_dataclass(
    GroupedQuantized,
    data_fields=["data", "scale", "amax", "first_dims", "last_dims", "offsets"],
    meta_fields=["fmt", "axis", "representation", "x_shape"],
)


# ---- geometry --------------------------------------------------------------------------------------------------
def _excl_cumsum(a):
    return jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(a, dtype=I32)])


def group_offsets(rows, cols) -> jnp.ndarray:
    """int32[N+1] element offsets: the exclusive cumsum of max(rows, 0) * max(cols, 0)."""
    return _excl_cumsum(jnp.maximum(rows, 0) * jnp.maximum(cols, 0))


def group_has_nan(x, rows, cols) -> jnp.ndarray:
    """bool[N]: group g (elements offsets[g]:offsets[g+1] of the flat buffer x) holds a NaN.

    The per-group form of the single-tensor rule (docs/numerics.md s6): an NVFP4 group's carried amax becomes NaN
    when its x_g holds one, while its encode keeps the finite amax, so the group dequantizes and multiplies to NaN.
    Computed from NaN counts at the group offsets: per 1024-element chunk (one fused pass over x), their prefix sum,
    and the partial chunk before each offset, gathered from x (a prefix sum over the whole buffer costs several passes
    on the CPU).
    """
    xf = jnp.asarray(x).reshape(-1)
    size, n = xf.shape[0], rows.shape[0]
    if size == 0:
        return jnp.zeros((n,), bool)
    chunks = -(-size // _NAN_CHUNK)
    per = jnp.isnan(jnp.pad(xf, (0, chunks * _NAN_CHUNK - size))).reshape(chunks, _NAN_CHUNK)
    before = _excl_cumsum(jnp.sum(per, axis=1, dtype=I32))  # NaNs before each chunk, [chunks + 1]
    off = jnp.clip(group_offsets(rows, cols), 0, size)
    q, r = off // _NAN_CHUNK, off % _NAN_CHUNK
    lane = jnp.arange(_NAN_CHUNK, dtype=I32)
    idx = jnp.minimum(q[:, None] * _NAN_CHUNK + lane, size - 1)
    partial = jnp.sum(jnp.isnan(xf[idx]) & (lane < r[:, None]), axis=1, dtype=I32)  # the chunk before the offset
    counts = before[q] + partial  # NaNs before each offset
    return counts[1:] > counts[:-1]


_NAN_CHUNK = 1024


def misaligned(rows, cols, axis: int, block: int) -> jnp.ndarray:
    """bool[N]: groups whose block-axis length (cols rowwise, rows columnwise; negative counts as 0) is not a
    multiple of `block` (computed on the device, for traced sizes)."""
    d = jnp.maximum(rows if axis == 0 else cols, 0)
    return d % block != 0


class _Layout:
    """Per-group geometry: dims, element offsets, block-aligned internal offsets, static sizes."""

    def __init__(self, rows, cols, offsets, total: int, bs: int):
        self.rows, self.cols, self.offsets, self.total, self.bs = rows, cols, offsets, total, bs
        self.n = rows.shape[0]
        sizes = jnp.maximum(rows, 0) * jnp.maximum(cols, 0)
        self.aoff = _excl_cumsum((sizes + bs - 1) // bs * bs)
        # Internal length: enough for every group block-aligned when the groups fit the buffer.
        self.internal = -(-(total + self.n * (bs - 1)) // bs) * bs

    def locate(self, pos, starts):
        """(group, local index, valid) of positions `pos` against the group starts int32[N+1]."""
        g = jnp.clip(jnp.searchsorted(starts, pos, side="right") - 1, 0, self.n - 1).astype(I32)
        local = pos - starts[g]
        return g, local, (pos >= 0) & (pos < starts[-1])


def _c2o(local, m, k):
    """Canonical row-major [m, k] local index -> row-major index in the transpose [k, m]."""
    k1 = jnp.maximum(k, 1)
    return (local % k1) * m + local // k1


def _o2c(local, m, k):
    """Row-major index in the transpose [k, m] -> canonical row-major [m, k] local index."""
    m1 = jnp.maximum(m, 1)
    return (local % m1) * k + local // m1


def _take(src, idx, limit):
    """src[idx] for 0 <= idx < limit, else 0 (src extended by one zero; nothing out of bounds).

    Floating-point sources are gathered as their unsigned-integer bit patterns: XLA:CPU's gather of bfloat16
    (jax 0.11.2 and 0.12) returned +0 for positive subnormals, which docs/numerics.md keeps.
    """
    src = jnp.asarray(src)
    if jnp.issubdtype(src.dtype, jnp.floating):
        ubits = jnp.dtype(f"uint{8 * src.dtype.itemsize}")
        return lax.bitcast_convert_type(_take(lax.bitcast_convert_type(src, ubits), idx, limit), src.dtype)
    ext = jnp.concatenate([src, jnp.zeros((1,), src.dtype)])
    idx = jnp.where((idx >= 0) & (idx < limit), idx, src.shape[0])
    return ext[idx]


# ---- quantize --------------------------------------------------------------------------------------------------
def group_key_words(key, n: int) -> jnp.ndarray:
    """uint32[N, 2]: the Philox key words of every group's stochastic-rounding stream, philox_key(fold_in(key, g))."""
    return jax.vmap(lambda i: sr.philox_key(jax.random.fold_in(key, i)))(jnp.arange(n, dtype=U32))


def grouped_quantize(x, fmt: Format, *, first_dims=None, last_dims=None, num_groups: int | None = None,
                     axis: int = -1, key=None) -> GroupedQuantized:
    """Quantize N groups held in one buffer x to `fmt` (see the module docstring for the representations).

    Args:
      x: bfloat16/float16/float32 buffer; 2-D for SAME_BOTH_DIMS / VARYING_FIRST_DIM / VARYING_LAST_DIM, 1-D for
        VARYING_BOTH_DIMS.
      fmt: NVFP4 (1D, optionally rht and/or stochastic_rounding) or MXFP8 (e4m3 / e5m2).
      first_dims, last_dims: int[N] group dims (may be traced); which are given picks the representation.
      num_groups: static N for SAME_BOTH_DIMS (optional consistency check otherwise).
      axis: -1 rowwise (blocks along each group's last dim), 0 columnwise (along its first dim).
      key: JAX PRNG key, required for NVFP4 stochastic rounding (group g uses fold_in(key, g)).

    Returns:
      GroupedQuantized (a jit-returnable pytree).

    Raises:
      ValueError: unsupported format options, bad dtype / shapes / axis, concrete misaligned or overrunning sizes.
    """
    x, rep, n, rows, cols, axis = validate(x, fmt, first_dims=first_dims, last_dims=last_dims,
                                           num_groups=num_groups, axis=axis, key=key)
    words = group_key_words(key, n) if fmt.needs_key else None
    data, scale, amax = quantize_groups(x, rows, cols, fmt, axis, words)
    if amax is not None:  # NaN stays visible per group (group_has_nan); the encode used the finite amax
        amax = jnp.where(group_has_nan(x, rows, cols), jnp.float32(jnp.nan), amax)
    return GroupedQuantized(data, scale, amax, rows, cols, group_offsets(rows, cols), fmt, axis, rep, tuple(x.shape))


def quantize_groups(x, rows, cols, fmt: Format, axis: int, key_words=None, amax=None):
    """The grouped quantize of an already validated buffer (jittable, vmappable; dims may be traced).

    x: bfloat16/float16/float32, any shape (read flat); rows, cols: int32[N]; axis: -1 or 0; key_words: uint32[N, 2]
    (`group_key_words`) for NVFP4 stochastic rounding, else None; amax: float32[N] given NVFP4 per-group tensor
    amaxes to encode with (after the RHT for RHT formats), or None to take each group's own. Returns (data [x.size]
    in fmt.data_dtype, scale [x.size // block] in fmt.scale_dtype, amax float32[N] (NVFP4) or None), misaligned
    groups poisoned.
    """
    bs, n, size = fmt.block_size, rows.shape[0], math.prod(x.shape)
    rows, cols = rows.astype(I32), cols.astype(I32)
    offsets = group_offsets(rows, cols)  # VARYING_LAST_DIM: M * cumsum(K_i)
    lay = _Layout(rows, cols, offsets, size, bs)
    transposed = axis == 0  # the internal (oriented) order is [K_g, M_g] for every columnwise format

    # Oriented gather: internal position -> group, oriented local index -> source element of x.
    g, local, valid = lay.locate(jnp.arange(lay.internal, dtype=I32), lay.aoff)
    m, k = rows[g], cols[g]
    src = offsets[g] + (_o2c(local, m, k) if transposed else local)
    y = _f32.widen(_take(x.reshape(-1), jnp.where(valid, src, -1), size))  # exact (subnormals kept)
    gb, lb = g[::bs], local[::bs] // bs  # per internal block: group and block index inside the group

    if isinstance(fmt, NVFP4):
        q, sc, amax = _nvfp4_blocks(y, fmt, gb, lb, n, key_words, amax)
    else:
        if amax is not None:
            raise ValueError(f"quantize_groups: a given amax needs an NVFP4 format, got {fmt!r}")
        q, sc = mxfp8.quantize(y, fmt)

    bad = misaligned(rows, cols, axis, bs)
    # Data: output position -> internal position (NVFP4 stores the oriented order; MXFP8 keeps [M_g, K_g]).
    p = jnp.arange(size, dtype=I32)
    g2, l2, v2 = lay.locate(p, offsets)
    mxfp8_col = transposed and not fmt.stores_block_axis_last  # MXFP8 columnwise keeps [M_g, K_g]
    l2 = _c2o(l2, rows[g2], cols[g2]) if mxfp8_col else l2
    data = _take(q, jnp.where(v2, lay.aoff[g2] + l2, -1), lay.internal)
    # Scales: output slot -> internal block.
    so = offsets // bs
    s = jnp.arange(size // bs, dtype=I32)
    g3, l3, v3 = lay.locate(s, so)
    l3 = _c2o(l3, rows[g3] // bs, cols[g3]) if mxfp8_col else l3
    scale = _take(sc, jnp.where(v3, lay.aoff[g3] // bs + l3, -1), lay.internal // bs)
    # Poison misaligned groups (traced sizes; see the module docstring).
    scale = jnp.where(v3 & bad[g3], U32(_SCALE_NAN[type(fmt)]), scale)
    if not fmt.has_tensor_amax:  # MXFP8: NaN codes (NVFP4: a NaN amax)
        data = jnp.where(v2 & bad[g2], U32(_MX_DATA_NAN), data)
    else:
        amax = jnp.where(bad, jnp.float32(jnp.nan), amax)
    return codes.to_dtype(data, fmt.data_dtype), codes.to_dtype(scale, fmt.scale_dtype), amax


_SCALE_NAN = {NVFP4: 0x7F, MXFP8: 0xFF}  # E4M3 and E8M0 NaN codes
_MX_DATA_NAN = 0x7F  # NaN in float8_e4m3fn and float8_e5m2


def _nvfp4_blocks(y, fmt: NVFP4, gb, lb, n: int, key_words, given=None):
    """NVFP4 1D math of `nvfp4.quantize` with a per-group tensor scale. y: f32 [internal], oriented and block
    aligned; gb / lb: group and in-group index of every 16-block; given: float32[N] amaxes to encode with, or None.
    Returns (codes, scale codes, amax f32[N])."""
    bs = fmt.block_size
    if fmt.rht:
        y = rht.forward(y)
    bbits = jnp.max(abs_bits(y).reshape(-1, bs), axis=1, initial=0)  # block amax bits (NaN ignored)
    # Per-group tensor amax: blocks outside every group are all-zero, so they change no max.
    if given is None:
        amax = _f32.from_bits(jax.ops.segment_max(bbits, gb, num_segments=n, indices_are_sorted=True))
    else:
        amax = jnp.asarray(given, jnp.float32).reshape(n)
    s_enc = nvfp4.global_encode_scale(amax, fmt.global_e4m3_max)  # [N]
    if fmt.use_4over6:
        q, sc = nvfp4_4over6.encode_blocks(y.reshape(-1, bs), _f32.from_bits(bbits), amax[gb], s_enc[gb],
                                           fmt.global_e4m3_max, fmt.err_mode_4over6, None)
        return q.reshape(-1), sc, amax
    rbytes = _sr_bytes(key_words, gb, lb) if fmt.stochastic_rounding else None
    q, sc = nvfp4.encode_blocks(y.reshape(-1, bs), _f32.from_bits(bbits), s_enc[gb], rbytes)
    return q.reshape(-1), sc, amax


def _sr_bytes(key_words, gb, lb):
    """Random bytes [blocks, 16]: block lb of group g takes Philox counter lb with the words key_words[g] — bytes
    16*lb .. 16*lb+15 of `sr.random_bytes(fold_in(key, g), group data shape)`."""
    k = key_words.astype(U32)[gb]
    ctr = lb.astype(U32)
    zero = jnp.zeros_like(ctr)
    w = jnp.stack(sr.philox4x32_10((ctr, zero, zero, zero), (k[:, 0], k[:, 1])), axis=-1)  # [blocks, 4]
    return ((w[..., None] >> jnp.array([0, 8, 16, 24], U32)) & U32(0xFF)).reshape(-1, 16)


def column_sums(x, rows, cols, rep: Representation) -> jnp.ndarray:
    """dbias: float32 column sums of every group's canonical [M_g, K_g] matrix (module docstring): [N, K] for
    SAME_BOTH_DIMS / VARYING_FIRST_DIM, [x.shape[1]] for VARYING_LAST_DIM (group g's K_g sums at sum(K_<g))."""
    if rep is Representation.VARYING_BOTH_DIMS:
        raise ValueError("grouped dbias needs a static column count: SAME_BOTH_DIMS, VARYING_FIRST_DIM or "
                         "VARYING_LAST_DIM, not VARYING_BOTH_DIMS")
    rows, cols = rows.astype(I32), cols.astype(I32)
    n, size = rows.shape[0], math.prod(x.shape)
    width = x.shape[1] if rep is Representation.VARYING_LAST_DIM else n * x.shape[1]
    offsets = group_offsets(rows, cols)
    lay = _Layout(rows, cols, offsets, size, 1)
    g, local, valid = lay.locate(jnp.arange(size, dtype=I32), offsets)
    seg = _excl_cumsum(jnp.maximum(cols, 0))[g] + local % jnp.maximum(cols[g], 1)
    sums = jax.ops.segment_sum(jnp.where(valid, _f32.widen(x.reshape(-1)), 0), jnp.where(valid, seg, width),
                               num_segments=width)
    return sums if rep is Representation.VARYING_LAST_DIM else sums.reshape(n, x.shape[1])


# ---- dequantize ------------------------------------------------------------------------------------------------
def grouped_dequantize(gq: GroupedQuantized, dtype: Any = jnp.float32) -> jnp.ndarray:
    """Inverse of `grouped_quantize`: `dtype` (f32/bf16/f16) values shaped like the original x.

    Group g equals `jax_fp4.reference.dequantize` of its single-tensor quantization; positions outside every group
    are 0; a poisoned (misaligned) group is NaN. Jittable and vmappable like the quantize.
    """
    return dequantize_groups(gq.data, gq.scale, gq.amax, gq.first_dims, gq.last_dims, gq.fmt, gq.axis, gq.x_shape,
                             dtype)


def dequantize_groups(data, scale, amax, rows, cols, fmt: Format, axis: int, x_shape, dtype=jnp.float32, *,
                      raw: bool = False) -> jnp.ndarray:
    """The grouped dequantize core (dims may be traced): data [prod(x_shape)], scale [prod(x_shape) // block],
    amax float32[N] (NVFP4; ignored when raw) -> `dtype`[x_shape].

    raw=True returns the block-scaled values without the tensor scale, in the stored domain (NVFP4 value(q) * s_b,
    no inverse RHT; MXFP8 as usual): exact in float32, the GEMM emulation's operand (dequantize = raw * amax/2688,
    up to the roundings of that product).
    """
    bs = fmt.block_size
    total = math.prod(x_shape)
    rows, cols = rows.astype(I32), cols.astype(I32)
    offsets = group_offsets(rows, cols)
    lay = _Layout(rows, cols, offsets, total, bs)
    transposed = axis == 0
    mxfp8_col = transposed and not fmt.stores_block_axis_last  # MXFP8 columnwise keeps [M_g, K_g]

    # Internal (oriented, block-aligned) position -> stored data position, internal block -> stored scale slot.
    g, local, valid = lay.locate(jnp.arange(lay.internal, dtype=I32), lay.aoff)
    m, k = rows[g], cols[g]
    didx = offsets[g] + (_o2c(local, m, k) if mxfp8_col else local)
    q = _take(codes.from_dtype(data), jnp.where(valid, didx, -1), total)
    gb, lb, vb = g[::bs], local[::bs] // bs, valid[::bs]
    sidx = offsets[gb] // bs + (_o2c(lb, rows[gb] // bs, cols[gb]) if mxfp8_col else lb)
    sc = _take(codes.from_dtype(scale), jnp.where(vb, sidx, -1), total // bs)

    if isinstance(fmt, NVFP4) and raw:
        v = _f32.mul(codes.e2m1_value(q).reshape(-1, bs), codes.small_float_value(
            codes.to_dtype(sc, jnp.float8_e4m3fn))[:, None]).reshape(-1)
    elif isinstance(fmt, NVFP4):
        v = nvfp4.dequantize(q, sc, amax[gb], None, fmt)  # per-block amax broadcasts like the scalar
    else:
        v = mxfp8.dequantize(codes.to_dtype(q, fmt.data_dtype), sc, fmt, dtype)

    # Output position (x layout) -> internal position.
    p = jnp.arange(total, dtype=I32)
    g2, l2, v2 = lay.locate(p, offsets)
    l2 = _c2o(l2, rows[g2], cols[g2]) if transposed else l2
    out = _take(v, jnp.where(v2, lay.aoff[g2] + l2, -1), lay.internal)
    return codes.output(out, dtype).reshape(x_shape)
