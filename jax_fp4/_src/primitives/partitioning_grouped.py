"""Sharding rules of `jf4_grouped_quantize` / `jf4_grouped_dequantize` (see the `partitioning.py` docstring).

The grouped row axis R is gathered; K is parallel in whole blocks where the flat buffers are row-major [R, K] views
(MXFP8 quantize, MXFP8 / NVFP4 rowwise dequantize of SAME_BOTH_DIMS / VARYING_FIRST_DIM); everything else runs on
replicated operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4._src.primitives.partitioning_base import mesh_size, shard_index, spec_of, split_factors
from jax_fp4.validation import Representation

__all__ = ["grouped_dequantize", "grouped_dequantize_cp", "grouped_k_axis", "grouped_quantize", "grouped_quantize_cp"]


def _grouped_k_granule(params, kind):
    """The K granule of a K-parallel grouped call (module docstring), or None when K is gathered."""
    if params.get("representation", Representation.VARYING_FIRST_DIM) not in (Representation.SAME_BOTH_DIMS,
                                                                             Representation.VARYING_FIRST_DIM):
        return None
    if kind == "grouped_quantize":
        fmts = [f for f in (params["row_fmt"], params["col_fmt"]) if f is not None]
        return None if any(f.has_tensor_amax for f in fmts) else max(f.block_size for f in fmts)
    if params["fmt"].stores_block_axis_last and params["axis"] == 0:  # NVFP4 columnwise: [K, M_g] per group
        return None
    return params["fmt"].block_size


def grouped_k_axis(mesh, shape, spec, granule, col_mx):
    """The mesh axes sharding K of a grouped x[R, K] (None: gathered): whole granules per shard, and R % 32 == 0
    where MXFP8 columnwise scales [R/32, K] are a view of the flat scale buffer."""
    R, K = shape
    k_ax = spec[1]
    if granule is None or k_ax is None or K % mesh_size(mesh, k_ax) or (K // mesh_size(mesh, k_ax)) % granule:
        return None
    return None if col_mx and R % 32 else k_ax


def _grouped_views(fmt, axis, R, K):
    """(data, scale) 2-D view shapes of one orientation's flat buffers for x[R, K] (K may be a shard's extent)."""
    bs = fmt.block_size
    return (R, K), ((R // bs, K) if axis == 0 else (R, K // bs))


def _grouped_replicated_cp(prim, params, avals_in, out_ndims):
    """A grouped call on replicated operands with replicated results (the gathered case)."""
    multi = prim.multiple_results
    z = iter(range(1000))

    def factors(nd):
        return " ".join(f"z{next(z)}" for _ in range(nd))

    rule = ", ".join(factors(len(a.shape)) for a in avals_in) + " -> " + ", ".join(factors(d) for d in out_ndims)

    def call(*args):
        out = prim.bind(*args, local=True, **params)
        return tuple(out) if multi else out

    f = custom_partitioning(call)

    def shardings(mesh):
        rep = NamedSharding(mesh, PartitionSpec())
        return tuple(rep for _ in out_ndims) if multi else rep

    def part(mesh, arg_shapes, result_shape):
        rep = NamedSharding(mesh, PartitionSpec())
        return mesh, call, shardings(mesh), (rep,) * len(arg_shapes)

    f.def_partition(partition=part, infer_sharding_from_operands=lambda mesh, a, r: shardings(mesh),
                    sharding_rule=rule)
    return f


def grouped_quantize_cp(prim, params, avals_in, avals_out, devices):
    row_fmt, col_fmt, dbias = params["row_fmt"], params["col_fmt"], params["dbias"]
    granule = _grouped_k_granule(params, "grouped_quantize")
    if granule is not None and (avals_in[0].shape[1] % granule or (col_fmt is not None and avals_in[0].shape[0] % 32)):
        granule = None
    if granule is None:
        return _grouped_replicated_cp(prim, params, avals_in, [len(a.shape) for a in avals_out])
    R, K = avals_in[0].shape
    orients = ((row_fmt, -1), (col_fmt, 0))
    Km, ks = split_factors("k", K, {row_fmt.block_size} if row_fmt is not None else set(), devices)

    def views(outs, k):  # [R, k] views of the flat data / scale buffers
        out = []
        for i, (fmt, axis) in enumerate(orients):
            o = outs[3 * i : 3 * i + 3]
            if fmt is None:
                out += list(o)
            else:
                d, s = _grouped_views(fmt, axis, R, k)
                out += [o[0].reshape(d), o[1].reshape(s), o[2]]
        return (*out, outs[6])

    @custom_partitioning
    def f(*args):
        return views(prim.bind(*args, local=True, **params), K)

    def specs(mesh, arg_shapes):
        k = grouped_k_axis(mesh, (R, K), spec_of(arg_shapes[0].sharding, 2), granule, col_fmt is not None)
        none, outs = PartitionSpec(None), []
        for fmt, _ in orients:
            outs += [none] * 3 if fmt is None else [PartitionSpec(None, k), PartitionSpec(None, k), none]
        outs.append(PartitionSpec(None, k) if dbias else none)
        return k, outs

    def infer(mesh, arg_shapes, result_shape):
        return tuple(NamedSharding(mesh, s) for s in specs(mesh, arg_shapes)[1])

    def part(mesh, arg_shapes, result_shape):
        k, outs = specs(mesh, arg_shapes)
        rep = NamedSharding(mesh, PartitionSpec(None))
        s = mesh_size(mesh, k)

        def lower(x, first_dims, last_dims, key_row, key_col, amax_in):
            outs = prim.bind(x, first_dims, last_dims // s, key_row, key_col, amax_in, local=True, **params)
            return views(outs, K // s)

        return (mesh, lower, tuple(NamedSharding(mesh, o) for o in outs),
                (NamedSharding(mesh, PartitionSpec(None, k)), rep, rep, rep, rep, rep))

    z, k = iter(range(100)), Km[1]
    res = []
    for fmt, axis in orients:
        if fmt is None:
            res += [f"z{next(z)}" for _ in range(3)]
        else:
            scale = f"z{next(z)} {k}" if axis == 0 else f"r {Km[fmt.block_size]}"
            res += [f"r {k}", scale, f"z{next(z)}"]
    res.append(f"n {k}" if dbias else f"z{next(z)}")
    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule=f"r {k}, n, n, n w0, n w1, a -> " + ", ".join(res), **ks)

    def call(*args):
        outs = f(*args)
        return tuple(o.reshape(-1) if i % 3 < 2 and i < 6 else o for i, o in enumerate(outs))

    return call


def grouped_dequantize_cp(prim, params, avals_in, devices):
    """Operands replicated (the flat buffers are not views of a K-sharded array in general: the primitive does not
    know the representation); each shard dequantizes its own K slice of the output. When every group spans all K
    columns (last_dims == K: SAME_BOTH_DIMS / VARYING_FIRST_DIM) the buffers are row-major [R, K] views and the
    shard reads only its slice; otherwise (a traced branch) it dequantizes everything and keeps its slice."""
    fmt, axis, x_shape = params["fmt"], params["axis"], tuple(params["x_shape"])
    granule = _grouped_k_granule(params, "grouped_dequantize") if len(x_shape) == 2 else None
    if granule is not None and (x_shape[1] % granule or (axis == 0 and x_shape[0] % 32)):
        granule = None
    if granule is None:
        return _grouped_replicated_cp(prim, params, avals_in, [len(x_shape)])
    R, K = x_shape

    @custom_partitioning
    def f(*args):
        return prim.bind(*args, local=True, **params)

    def k_axis(mesh, sharding):
        return grouped_k_axis(mesh, (R, K), spec_of(sharding, 2), granule, axis == 0)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(None, None))

    def part(mesh, arg_shapes, result_shape):
        k = k_axis(mesh, getattr(result_shape, "sharding", None))
        rep = NamedSharding(mesh, PartitionSpec())
        s = mesh_size(mesh, k)
        kl = K // s
        local = dict(params, x_shape=(R, kl))

        def lower(data, scale, amax, first_dims, last_dims):
            if s == 1:
                return prim.bind(data, scale, amax, first_dims, last_dims, local=True, **params)
            k0 = shard_index(mesh, k) * kl
            d, sv = _grouped_views(fmt, axis, R, K)
            bs = 1 if axis == 0 else fmt.block_size

            def sliced(_):
                dl = jax.lax.dynamic_slice_in_dim(data.reshape(d), k0, kl, 1).reshape(-1)
                sl = jax.lax.dynamic_slice_in_dim(scale.reshape(sv), k0 // bs, sv[1] // s, 1).reshape(-1)
                return prim.bind(dl, sl, amax, first_dims, jnp.full_like(last_dims, kl), local=True, **local)

            def whole(_):
                out = prim.bind(data, scale, amax, first_dims, last_dims, local=True, **params)
                return jax.lax.dynamic_slice_in_dim(out, k0, kl, 1)

            return jax.lax.cond(jnp.all(last_dims == K), sliced, whole, None)

        return mesh, lower, NamedSharding(mesh, PartitionSpec(None, k)), (rep,) * len(arg_shapes)

    f.def_partition(partition=part, infer_sharding_from_operands=infer,
                    sharding_rule="d, s, a, n, n -> r k")
    return f


# The partition functions of `partitioning_base.register_lowerings`.
def grouped_quantize(prim, params, avals_in, avals_out, devices):
    return grouped_quantize_cp(prim, params, avals_in, avals_out, devices)


def grouped_dequantize(prim, params, avals_in, avals_out, devices):
    return grouped_dequantize_cp(prim, params, avals_in, devices)
