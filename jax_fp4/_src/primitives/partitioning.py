"""Sharding rules of the primitives: `custom_partitioning` with a Shardy sharding rule (and the GSPMD callbacks).

Each primitive's lowering (`lowering(inner)`) routes through a `custom_partitioning` function whose per-shard body
binds the same primitive with `local=True`, which lowers to the kernel (or the reference) directly. On one device
and inside shard_map, custom_partitioning inlines that body, so nothing changes there.

Rules:
  * jf4_quantize (x[P, M, K]): parallel over P, M and K as long as each shard holds whole blocks, 2D tiles and
    1x64 windows (and whole 128-row tiles of swizzled scales, whole 64-row dbias stripes); a dimension that would
    split one is gathered instead. The amax operands arrive replicated, so every shard encodes with the global
    tensor scale: sharded output == unsharded output.
  * jf4_amax / jf4_rht_amax: each shard reduces its part, then `lax.pmax` over the mesh axes that shard x; the
    result is replicated and equals the unsharded amax bit for bit (max is exact and order-free).
"""

from __future__ import annotations

import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4.formats import NVFP4

__all__ = ["lowering", "quantize_result_specs", "quantize_x_spec"]


def _spec(sharding, ndim):
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    return spec + (None,) * (ndim - len(spec))


def _size(mesh, ax) -> int:
    if ax is None:
        return 1
    axes = ax if isinstance(ax, tuple) else (ax,)
    return math.prod(mesh.shape[a] for a in axes)


def _names(spec):
    out = []
    for ax in spec:
        if ax is not None:
            out.extend(ax if isinstance(ax, tuple) else (ax,))
    return tuple(out)


# ---- quantize ---------------------------------------------------------------------------------------------------
def _granule(fmt, blocked: bool) -> int:
    """Local extent a shard of x must keep a multiple of, along an axis of one orientation's output.

    blocked: the axis is that orientation's block axis (block, 2D tile, 1x64 window); otherwise it is the row axis
    (2D tiles and 1x64 column windows span 16 / 64 rows)."""
    if fmt is None:
        return 1
    if isinstance(fmt, NVFP4):
        if fmt.local_1x64:
            return fmt.window_size
        return fmt.block_size if blocked else (fmt.tile_2d if fmt.scaling_2d else 1)
    return fmt.block_size if blocked else 1


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
    m_loc, k_loc = M // _size(mesh, m_ax), K // _size(mesh, k_ax)
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
                PartitionSpec(p, m, k) if isinstance(row_fmt, NVFP4) and row_fmt.local_1x64 else none]
    if col_fmt is None:
        out += [none] * 3
    elif isinstance(col_fmt, NVFP4):
        out += [PartitionSpec(p, k, m), PartitionSpec(k, None) if swz else PartitionSpec(p, k, m),
                PartitionSpec(p, k, m) if col_fmt.local_1x64 else none]
    else:
        out += [PartitionSpec(p, m, k), PartitionSpec(k, None) if swz else PartitionSpec(p, m, k), none]
    out.append(PartitionSpec(p, m, k) if dbias else none)
    return out


def _quantize_rule(row_fmt, col_fmt, scale_layout, dbias):
    """Shardy rule: factors p m k of x; block-count dims and swizzled/placeholder dims get factors of their own."""
    swz = scale_layout == "swizzled"
    outs, z = [], iter(range(100))

    def own():
        return f"z{next(z)}"

    if row_fmt is None:
        outs += [own(), own(), own()]
    else:
        outs += ["p m k", f"{own()} {own()}" if swz else f"p m {own()}",
                 f"p m {own()}" if isinstance(row_fmt, NVFP4) and row_fmt.local_1x64 else own()]
    if col_fmt is None:
        outs += [own(), own(), own()]
    elif isinstance(col_fmt, NVFP4):
        outs += ["p k m", f"{own()} {own()}" if swz else f"p k {own()}",
                 f"p k {own()}" if col_fmt.local_1x64 else own()]
    else:
        outs += ["p m k", f"{own()} {own()}" if swz else f"p {own()} k", own()]
    outs.append(f"p {own()} k" if dbias else own())
    return "p m k, p, p, q, r -> " + ", ".join(outs)


def _quantize_cp(prim, params):
    row_fmt, col_fmt, layout, dbias = params["row_fmt"], params["col_fmt"], params["scale_layout"], params["dbias"]

    @custom_partitioning
    def f(*args):
        return tuple(prim.bind(*args, local=True, **params))

    def specs(mesh, arg_shapes):
        xs = quantize_x_spec(mesh, arg_shapes[0].shape, _spec(arg_shapes[0].sharding, 3), row_fmt, col_fmt, layout,
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

        def lower(*a):
            return tuple(prim.bind(*a, local=True, **params))

        return mesh, lower, tuple(NamedSharding(mesh, s) for s in outs), args

    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule=_quantize_rule(row_fmt, col_fmt, layout, dbias))
    return f


# ---- amax -------------------------------------------------------------------------------------------------------
def _amax_cp(prim, params, ndim, out_ndim):
    """Reductions to a replicated result: jf4_amax (out_ndim 0) and jf4_rht_amax (x[P, M, K] -> [P], P kept)."""
    letters = "abcdefghijklmnopqrstuvwxy"[:ndim]

    @custom_partitioning
    def f(x):
        return prim.bind(x, local=True, **params)

    def x_spec(mesh, arg_shapes):
        spec = list(_spec(arg_shapes[0].sharding, ndim))
        if params.get("orientation") is not None:  # RHT 16-chunks must not straddle shards
            axis = 2 if params["orientation"] == "row" else 1
            if arg_shapes[0].shape[axis] // _size(mesh, spec[axis]) % 16:
                spec[axis] = None
        if out_ndim:
            spec[0] = None  # keep P whole: the result [P] stays replicated
        return tuple(spec)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec())

    def part(mesh, arg_shapes, result_shape):
        spec = x_spec(mesh, arg_shapes)
        axes = _names(spec)

        def lower(x):
            out = prim.bind(x, local=True, **params)
            return jax.lax.pmax(out, axes) if axes else out

        return mesh, lower, NamedSharding(mesh, PartitionSpec()), (NamedSharding(mesh, PartitionSpec(*spec)),)

    out = letters[0] if out_ndim else ""
    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule=f"{' '.join(letters)} -> {out}" if ndim else " -> ",
                    need_replication_factors=tuple(letters[:1]) if out_ndim else ())
    return f


def _single_device(ctx) -> bool:
    ac = ctx.module_context.axis_context
    return getattr(ac, "num_devices", 2) == 1 or (hasattr(ac, "device_assignment") and ac.device_assignment is None)


def lowering(prim, inner, kind: str):
    """A lowering rule for `prim`: `inner` for the per-shard (local=True) bind, else the custom_partitioning call."""

    def rule(ctx, *args, local=False, **params):
        if local or not ctx.avals_in[0].shape or _single_device(ctx):
            return inner(ctx, *args, **params)
        if kind == "quantize":
            f = _quantize_cp(prim, params)
        else:
            f = _amax_cp(prim, params, len(ctx.avals_in[0].shape), len(ctx.avals_out[0].shape))
        return mlir.lower_fun(lambda *a: f(*a), multiple_results=prim.multiple_results)(ctx, *args)

    return rule

