"""Sharding rules of the primitives: `custom_partitioning` with a Shardy sharding rule (and the GSPMD callbacks).

Each primitive's lowering (`lowering(inner)`) routes through a `custom_partitioning` function whose per-shard body
binds the same primitive with `local=True`, which lowers to the kernel (or the reference) directly. On one device
and inside shard_map, custom_partitioning inlines that body, so nothing changes there.

Rules:
  * jf4_quantize (x[P, M, K]): parallel over P, M and K as long as each shard holds whole blocks, 2D tiles and
    1x64 windows (and whole 128-row tiles of swizzled scales, whole 64-row dbias stripes); a dimension that would
    split one is gathered instead. The amax operands arrive replicated, so every shard encodes with the global
    tensor scale: sharded output == unsharded output. Stochastic rounding: the element at global index i of an
    orientation's stored data (rowwise [P, M, K], columnwise [P, K, M]) takes byte i % 16 of Philox(i // 16) with
    the caller's key, on every sharding. Each shard's body turns the replicated key words uint32[2] into the stream
    words uint32[8] of its shard (`reference.sr.shard_words`: the key, the shard's offsets — `lax.axis_index` over
    the mesh axes sharding each dim, times the local extent, traced — and the global dims, static), which the
    kernel and the reference both index by the global position; the offsets never leave the device. The Philox
    granule of 16 elements needs the block-axis offset % 16 == 0, which whole blocks per shard guarantee.
  * jf4_amax / jf4_rht_amax: each shard reduces its part, then `lax.pmax` over the mesh axes that shard x; the
    result is replicated and equals the unsharded amax bit for bit (max is exact and order-free).
  * jf4_dequantize (data[P, R, C]): parallel over P, R and C as long as each shard holds whole blocks (and 1x64
    windows) along the block axis; swizzled scales stay sharded only along the scale-matrix rows in whole 128-row
    tiles (the block-count columns interleave across 4-column tiles), otherwise the axis is gathered. The amax is a
    replicated operand (sharded with P when it holds one value per p), so sharded output == unsharded output.
  * jf4_swizzle / jf4_unswizzle ([..., rows, cols]): leading dimensions parallel; rows sharded in whole 128-row
    tiles (then the padded matrix has no padding rows and each shard's tiles are contiguous); columns gathered.
  * jf4_grouped_quantize / jf4_grouped_dequantize (x[R, K], groups of rows; `partitioning_grouped.py`): the
    grouped row axis R is always gathered (the groups are traced, data-dependent row ranges). K is parallel, in
    whole 32-blocks, only for SAME_BOTH_DIMS / VARYING_FIRST_DIM (every group has all K columns; VARYING_LAST_DIM /
    VARYING_BOTH_DIMS gather everything) and only where the flat buffers are row-major views of x: quantize with
    MXFP8 formats only (rowwise data / scales [R, K] / [R, K/32], columnwise [R, K] / [R/32, K], dbias [N, K]);
    dequantize of MXFP8 (either orientation) and NVFP4 rowwise (whole 16-blocks, the RHT's 16-chunks). A quantize
    shard runs the primitive on its K slice with last_dims // shards and returns [R, K/s] views of its flat
    buffers; the flat results are those views reshaped, which XLA assembles from the shards (the codes move, never
    x). The dequantize operands are replicated (the primitive does not know the representation) and a shard of a
    K-sharded output reads only its K slice when every last_dim == K, else (a traced branch) dequantizes all and
    keeps its slice. Gathered (x replicated, one call per device): any NVFP4 quantize -- the per-group tensor amax
    is computed inside the fused kernel (and the reference) and feeds the encoding, so a shard would encode with a
    partial amax; sharding it needs an amax operand -- hence also NVFP4 stochastic rounding (its per-group stream
    is indexed by the position in the whole group); NVFP4 columnwise dequantize (its data [K, M_g] per group
    interleaves the K slices); MXFP8 columnwise with R % 32 != 0. A poisoned (misaligned) group stays NaN but may
    sit elsewhere in a K-sharded MXFP8 buffer.
"""

from __future__ import annotations

import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4._src.primitives.partitioning_base import (
    axis_names,
    divisible_spec,
    mesh_size,
    shard_index,
    spec_of,
    split_factors,
)
from jax_fp4.reference import sr

__all__ = ["amax", "dequantize", "dequantize_specs", "quantize", "quantize_result_specs", "quantize_x_spec", "swizzle",
           "swizzle_spec"]


# ---- quantize ---------------------------------------------------------------------------------------------------
def _granule(fmt, blocked: bool) -> int:
    """Local extent a shard of x must keep a multiple of, along an axis of one orientation's output.

    blocked: the axis is that orientation's block axis (block, 2D tile, 1x64 window); otherwise it is the row axis
    (2D tiles and 1x64 column windows span 16 / 64 rows)."""
    if fmt is None:
        return 1
    if fmt.local_1x64:
        return fmt.window_size
    return fmt.block_size if blocked else (fmt.tile_2d if fmt.scaling_2d else 1)


def quantize_x_spec(mesh, shape, spec, row_fmt, col_fmt, scale_layout, dbias):
    """The sharding of x[P, M, K] the kernel runs under.

    An axis stays sharded when every shard's extent is a whole number of the blocks, 2D tiles and 1x64 windows
    along it (rowwise blocks run along K, columnwise along M), so no block straddles two shards and each shard's
    outputs are slices of the global ones; otherwise it is gathered. Swizzled scales stay sharded only along the
    scale-matrix rows in whole 128-row tiles (P == 1); dbias stripes need M % 64 per shard.
    """
    P, M, K = shape
    p_ax, m_ax, k_ax = spec
    swz = scale_layout == "swizzled"
    m_loc, k_loc = M // mesh_size(mesh, m_ax), K // mesh_size(mesh, k_ax)
    need_m = math.lcm(_granule(row_fmt, False), _granule(col_fmt, True), 64 if dbias else 1)
    need_k = math.lcm(_granule(row_fmt, True), _granule(col_fmt, False))
    if swz:
        need_m = math.lcm(need_m, 128 if row_fmt is not None else 1)
        need_k = math.lcm(need_k, 128 if col_fmt is not None else 1)
        if row_fmt is not None and col_fmt is None:
            k_ax = None  # scale-matrix columns: 4-column tiles interleave across shards
        elif col_fmt is not None and row_fmt is None:
            m_ax = None
        else:
            m_ax = k_ax = None
        if P > 1 or p_ax is not None:
            p_ax = m_ax = k_ax = None  # the padded 2-D layout is contiguous per shard only for P == 1
    if m_loc % need_m:
        m_ax = None
    if k_loc % need_k:
        k_ax = None
    return p_ax, m_ax, k_ax


def quantize_result_specs(x_spec, row_fmt, col_fmt, scale_layout, dbias):
    """PartitionSpecs of the seven results for x sharded as x_spec (see quantize_x_spec)."""
    p, m, k = x_spec
    swz = scale_layout == "swizzled"
    none = PartitionSpec(None)
    out = []
    if row_fmt is None:
        out += [none] * 3
    else:
        out += [PartitionSpec(p, m, k), PartitionSpec(m, None) if swz else PartitionSpec(p, m, k),
                PartitionSpec(p, m, k) if row_fmt.local_1x64 else none]
    if col_fmt is None:
        out += [none] * 3
    elif col_fmt.stores_block_axis_last:  # NVFP4: data [P, K, M]
        out += [PartitionSpec(p, k, m), PartitionSpec(k, None) if swz else PartitionSpec(p, k, m),
                PartitionSpec(p, k, m) if col_fmt.local_1x64 else none]
    else:
        out += [PartitionSpec(p, m, k), PartitionSpec(k, None) if swz else PartitionSpec(p, m, k), none]
    out.append(PartitionSpec(p, m, k) if dbias else none)
    return out


def _divisors(fmt, blocked: bool, compact: bool):
    """The block lengths one orientation's outputs divide an axis of x by (compact scales, 1x64 window amaxes)."""
    if fmt is None or not blocked:
        return set()
    out = {fmt.block_size} if compact else set()
    if fmt.local_1x64:
        out.add(fmt.window_size)
    return out


def _quantize_rule(row_fmt, col_fmt, scale_layout, dbias, shape, devices):
    """Shardy rule: factors p m k of x, split into compound factors where an output holds block counts (see
    split_factors); swizzled and placeholder dims get factors of their own. Returns (rule, factor sizes)."""
    swz = scale_layout == "swizzled"
    _, M, K = shape
    stripes = {64} if dbias and M % 64 == 0 else set()
    Km, ks = split_factors("k", K, _divisors(row_fmt, True, not swz), devices)
    Mm, ms = split_factors("m", M, _divisors(col_fmt, True, not swz) | stripes, devices)
    m, k = Mm[1], Km[1]
    outs, z = [], iter(range(100))

    def own():
        return f"z{next(z)}"

    if row_fmt is None:
        outs += [own(), own(), own()]
    else:
        outs += [f"p {m} {k}", f"{own()} {own()}" if swz else f"p {m} {Km[row_fmt.block_size]}",
                 f"p {m} {Km[64]}" if row_fmt.local_1x64 else own()]
    if col_fmt is None:
        outs += [own(), own(), own()]
    elif col_fmt.stores_block_axis_last:  # NVFP4: data [P, K, M]
        outs += [f"p {k} {m}", f"{own()} {own()}" if swz else f"p {k} {Mm[col_fmt.block_size]}",
                 f"p {k} {Mm[64]}" if col_fmt.local_1x64 else own()]
    else:
        outs += [f"p {m} {k}", f"{own()} {own()}" if swz else f"p {Mm[col_fmt.block_size]} {k}", own()]
    outs.append((f"p {Mm[64]} {k}" if stripes else f"p {own()} {k}") if dbias else own())  # [P, M/64, K] stripes
    return f"p {m} {k}, p, p, q, r -> " + ", ".join(outs), {**ks, **ms}


def _shard_keys(mesh, x_spec, global_shape, local_shape, key_row, key_col, sr_row, sr_col):
    """The per-shard stream words uint32[8] of the stochastic-rounding orientations (module docstring): the shard's
    offsets (p, m, k) = shard index * local extent, the global (P, M, K); columnwise data is [P, K, M]."""
    P, M, K = global_shape
    if max(global_shape) >= 2**32:
        raise ValueError(f"jf4_quantize: stochastic rounding of a sharded x{list(global_shape)} needs dims < 2**32")
    # The Philox granule: a 16-block must be one whole Philox output, so the block-axis offset (and the local
    # block-axis extent) must be a multiple of 16; quantize_x_spec keeps whole blocks per shard, so it is.
    for on, axis in ((sr_row, 2), (sr_col, 1)):
        if on and local_shape[axis] % 16:  # pragma: no cover - an invariant of quantize_x_spec
            raise AssertionError(f"jf4_quantize: SR shard {list(local_shape)} splits a 16-block of "
                                 f"x{list(global_shape)}")
    po, mo, ko = (shard_index(mesh, ax) * n for ax, n in zip(x_spec, local_shape, strict=True))
    if sr_row:
        key_row = sr.shard_words(key_row, (po, mo, ko), (P, M, K))
    if sr_col:
        key_col = sr.shard_words(key_col, (po, ko, mo), (P, K, M))
    return key_row, key_col


def _quantize_cp(prim, params, avals_in, devices):
    row_fmt, col_fmt, layout, dbias = params["row_fmt"], params["col_fmt"], params["scale_layout"], params["dbias"]
    sr_row, sr_col = (f is not None and f.needs_key for f in (row_fmt, col_fmt))

    @custom_partitioning
    def f(*args):
        return tuple(prim.bind(*args, local=True, **params))

    def specs(mesh, arg_shapes):
        xs = quantize_x_spec(mesh, arg_shapes[0].shape, spec_of(arg_shapes[0].sharding, 3), row_fmt, col_fmt, layout,
                             dbias)
        return xs, quantize_result_specs(xs, row_fmt, col_fmt, layout, dbias)

    def infer(mesh, arg_shapes, result_shape):
        _, outs = specs(mesh, arg_shapes)
        return tuple(NamedSharding(mesh, s) for s in outs)

    def part(mesh, arg_shapes, result_shape):
        xs, outs = specs(mesh, arg_shapes)
        rep = NamedSharding(mesh, PartitionSpec(None))
        args = (NamedSharding(mesh, PartitionSpec(*xs)), NamedSharding(mesh, PartitionSpec(xs[0])),
                NamedSharding(mesh, PartitionSpec(xs[0])), rep, rep)

        def lower(x, amax_row, amax_col, key_row, key_col):
            if (sr_row or sr_col) and any(ax is not None for ax in xs):
                key_row, key_col = _shard_keys(mesh, xs, arg_shapes[0].shape, x.shape, key_row, key_col, sr_row,
                                               sr_col)
            return tuple(prim.bind(x, amax_row, amax_col, key_row, key_col, local=True, **params))

        return mesh, lower, tuple(NamedSharding(mesh, s) for s in outs), args

    rule, sizes = _quantize_rule(row_fmt, col_fmt, layout, dbias, avals_in[0].shape, devices)
    f.def_partition(partition=part, infer_sharding_from_operands=infer, sharding_rule=rule, **sizes)
    return f


# ---- amax -------------------------------------------------------------------------------------------------------
def _amax_cp(prim, params, ndim, out_ndim):
    """Reductions to a replicated result: jf4_amax (out_ndim 0) and jf4_rht_amax (x[P, M, K] -> [P], P kept)."""
    letters = "abcdefghijklmnopqrstuvwxy"[:ndim]

    @custom_partitioning
    def f(x):
        return prim.bind(x, local=True, **params)

    def x_spec(mesh, arg_shapes):
        spec = list(spec_of(arg_shapes[0].sharding, ndim))
        if params.get("orientation") is not None:  # RHT 16-chunks must not straddle shards
            axis = 2 if params["orientation"] == "row" else 1
            if arg_shapes[0].shape[axis] // mesh_size(mesh, spec[axis]) % 16:
                spec[axis] = None
        if out_ndim:
            spec[0] = None  # keep P whole: the result [P] stays replicated
        return tuple(spec)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec())

    def part(mesh, arg_shapes, result_shape):
        spec = x_spec(mesh, arg_shapes)
        axes = axis_names(spec)

        def lower(x):
            out = prim.bind(x, local=True, **params)
            return jax.lax.pmax(out, axes) if axes else out

        return mesh, lower, NamedSharding(mesh, PartitionSpec()), (NamedSharding(mesh, PartitionSpec(*spec)),)

    out = letters[0] if out_ndim else ""
    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule=f"{' '.join(letters)} -> {out}" if ndim else " -> ",
                    need_replication_factors=tuple(letters[:1]) if out_ndim else ())
    return f


# ---- dequantize ---------------------------------------------------------------------------------------------------
def dequantize_specs(mesh, shape, spec, fmt, scale_layout, mx_columnwise, transpose_out):
    """(data, scale, window amax, out) PartitionSpec tuples for data[P, R, C] sharded as `spec` (see the docstring)."""
    P, R, C = shape
    p, r, c = divisible_spec(mesh, shape, spec)
    granule = fmt.window_size if fmt.local_1x64 else fmt.block_size
    if mx_columnwise:
        r = None if (R // mesh_size(mesh, r)) % granule else r
    else:
        c = None if (C // mesh_size(mesh, c)) % granule else c
    if scale_layout == "swizzled":  # scale matrix [rows (p, x), block counts]: x = C (MXFP8 columnwise) else R
        X = C if mx_columnwise else R
        x = c if mx_columnwise else r
        if mx_columnwise:
            r = None
        else:
            c = None
        if P == 1:
            p = None
            x = None if (X // mesh_size(mesh, x)) % 128 else x
            scale = (x, None)
        else:  # rows of one p are contiguous only while x is whole
            x = None
            p = None if (P // mesh_size(mesh, p)) * X % 128 else p
            scale = (p, None)
        r, c = (r, x) if mx_columnwise else (x, c)
    else:
        scale = (p, r, c)
    data = (p, r, c)
    return data, scale, data, ((p, c, r) if transpose_out else data)


def _dequantize_rule(fmt, scale_layout, mx_columnwise, transpose_out, amax_per_p, shape, devices):
    """Shardy rule: data "p r c" with the block axis split into compound factors where the compact scales and the
    1x64 window amaxes hold block counts (see split_factors); swizzled dims get factors of their own. Returns (rule,
    factor sizes)."""
    compact = scale_layout == "compact"
    _, R, C = shape
    Rm, rs = split_factors("r", R, _divisors(fmt, mx_columnwise, compact), devices)
    Cm, cs = split_factors("c", C, _divisors(fmt, not mx_columnwise, compact), devices)
    r, c = Rm[1], Cm[1]
    if not compact:
        scale = "s0 s1"
    else:
        scale = f"p {Rm[fmt.block_size]} {c}" if mx_columnwise else f"p {r} {Cm[fmt.block_size]}"
    amax = "p" if amax_per_p else "a0"
    wamax = f"p {r} {Cm[64]}" if fmt.local_1x64 else "w0"
    out = f"p {c} {r}" if transpose_out else f"p {r} {c}"
    return f"p {r} {c}, {scale}, {amax}, {wamax} -> {out}", {**rs, **cs}


def _dequantize_cp(prim, params, avals_in, devices):
    fmt, layout = params["fmt"], params["scale_layout"]
    mx_col, transpose = params["mx_columnwise"], params["transpose_out"]
    P = avals_in[0].shape[0]
    amax_per_p = P > 1 and tuple(avals_in[2].shape) == (P,)
    local_1x64 = fmt.local_1x64

    @custom_partitioning
    def f(*args):
        return prim.bind(*args, local=True, **params)

    def specs(mesh, arg_shapes):
        return dequantize_specs(mesh, arg_shapes[0].shape, spec_of(arg_shapes[0].sharding, 3), fmt, layout, mx_col,
                                transpose)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(*specs(mesh, arg_shapes)[3]))

    def part(mesh, arg_shapes, result_shape):
        data, scale, wamax, out = specs(mesh, arg_shapes)
        rep = NamedSharding(mesh, PartitionSpec(None))
        args = (NamedSharding(mesh, PartitionSpec(*data)), NamedSharding(mesh, PartitionSpec(*scale)),
                NamedSharding(mesh, PartitionSpec(data[0])) if amax_per_p else rep,
                NamedSharding(mesh, PartitionSpec(*wamax)) if local_1x64 else rep)

        def lower(*a):
            return prim.bind(*a, local=True, **params)

        return mesh, lower, NamedSharding(mesh, PartitionSpec(*out)), args

    rule, sizes = _dequantize_rule(fmt, layout, mx_col, transpose, amax_per_p, avals_in[0].shape, devices)
    f.def_partition(partition=part, infer_sharding_from_operands=infer, sharding_rule=rule, **sizes)
    return f


# ---- swizzle / unswizzle ------------------------------------------------------------------------------------------
def swizzle_spec(mesh, shape, spec, whole_rows: bool):
    """Operand and result spec of jf4_swizzle / jf4_unswizzle for an operand of `shape` sharded as `spec`.

    whole_rows: the compact and padded matrices have the same number of rows (rows % 128 == 0), the condition for
    sharding them at all; then each shard must hold whole 128-row tiles. Columns are always gathered."""
    spec = list(divisible_spec(mesh, shape, spec))
    rows = shape[-2]
    if not whole_rows or (rows // mesh_size(mesh, spec[-2])) % 128:
        spec[-2] = None
    spec[-1] = None
    return tuple(spec)


def _swizzle_cp(prim, params, avals_in, avals_out):
    nd = len(avals_in[0].shape)
    whole_rows = avals_in[0].shape[-2] == avals_out[0].shape[-2]
    lead = [f"b{i}" for i in range(nd - 2)]
    rows_out = "r" if whole_rows else "q"

    @custom_partitioning
    def f(a):
        return prim.bind(a, local=True, **params)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(*swizzle_spec(mesh, arg_shapes[0].shape,
                                                               spec_of(arg_shapes[0].sharding, nd), whole_rows)))

    def part(mesh, arg_shapes, result_shape):
        spec = swizzle_spec(mesh, arg_shapes[0].shape, spec_of(arg_shapes[0].sharding, nd), whole_rows)
        local = dict(params)
        if "rows" in local:  # jf4_unswizzle: each shard restores its own (whole-tile) rows
            local["rows"] = params["rows"] // mesh_size(mesh, spec[-2])
        s = NamedSharding(mesh, PartitionSpec(*spec))

        def lower(a):
            return prim.bind(a, local=True, **local)

        return mesh, lower, s, (s,)

    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule=f"{' '.join([*lead, 'r', 'c'])} -> {' '.join([*lead, rows_out, 'd'])}")
    return f


# The partition functions of `partitioning_base.register_lowerings`: (prim, params, avals_in, avals_out, devices) ->
# the custom_partitioning function of one call.
def quantize(prim, params, avals_in, avals_out, devices):
    return _quantize_cp(prim, params, avals_in, devices)


def dequantize(prim, params, avals_in, avals_out, devices):
    return _dequantize_cp(prim, params, avals_in, devices)


def swizzle(prim, params, avals_in, avals_out, devices):
    """jf4_swizzle and jf4_unswizzle."""
    return _swizzle_cp(prim, params, avals_in, avals_out)


def amax(prim, params, avals_in, avals_out, devices):
    """jf4_amax and jf4_rht_amax."""
    return _amax_cp(prim, params, len(avals_in[0].shape), len(avals_out[0].shape))
