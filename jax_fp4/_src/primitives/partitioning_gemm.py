"""Sharding rule of `jf4_gemm` (a[M, K] . b[N, K] -> out[M, N], out_amax): `custom_partitioning` with a Shardy rule.

M is parallel as a_data's rows are sharded, N as b_data's rows are (N gathered where it would reuse one of M's mesh
axes); K is gathered, so each shard runs the whole contraction of its rows. The operands follow: a's scales and
1x64 window amax with M, b's with N, the bias with N; NVFP4 tensor amaxes are replicated scalars. The output amax
is the `lax.pmax` of the shards' amaxes over the mesh axes of M and N (max is exact and order-free). A dimension
whose mesh axes do not divide it is gathered. Each output element is the same K-sum as without sharding; the
kernel's K loop does not depend on M or N, while XLA's dots in the emulation (the CPU) may order their float32 sums
by shape, so sharded results are compared against bounds there. Data-parallel training (x sharded by rows, w
replicated) thus runs fprop and dgrad without a collective; wgrad contracts over the tokens, the sharded axis, so
its (packed) operands are gathered.
"""

from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4._src.primitives.partitioning_base import axis_names, divisible_spec, spec_of

__all__ = ["gemm"]


def _rows_specs(mesh, arg_shapes):
    """(m, n): the mesh axes of M and N (None: gathered)."""
    a, b = arg_shapes[0], arg_shapes[3]
    m = divisible_spec(mesh, a.shape, spec_of(a.sharding, 2))[0]
    n = divisible_spec(mesh, b.shape, spec_of(b.sharding, 2))[0]
    if n is not None and set(axis_names((n,))) & set(axis_names((m,))):
        n = None
    return m, n


def _operand_specs(shapes, m, n):
    """PartitionSpecs of the seven operands given the mesh axes of M and N."""
    def rows(shape, ax):
        return PartitionSpec(ax, None) if len(shape) == 2 else PartitionSpec()

    a_data, a_scale, a_aux, b_data, b_scale, b_aux, bias = shapes
    return (PartitionSpec(m, None), PartitionSpec(m, None), rows(a_aux, m), PartitionSpec(n, None),
            PartitionSpec(n, None), rows(b_aux, n), PartitionSpec(n) if bias[0] else PartitionSpec(None))


def _gemm_cp(prim, params, avals_in):
    @custom_partitioning
    def f(*args):
        return tuple(prim.bind(*args, local=True, **params))

    shapes = [tuple(a.shape) for a in avals_in]

    def infer(mesh, arg_shapes, result_shape):
        m, n = _rows_specs(mesh, arg_shapes)
        return (NamedSharding(mesh, PartitionSpec(m, n)), NamedSharding(mesh, PartitionSpec()))

    def part(mesh, arg_shapes, result_shape):
        m, n = _rows_specs(mesh, arg_shapes)
        axes = axis_names((m, n))

        def lower(*args):
            out, amax = prim.bind(*args, local=True, **params)
            if params["emit_amax"] and axes:
                amax = jax.lax.pmax(amax, axes)
            return out, amax

        args = tuple(NamedSharding(mesh, s) for s in _operand_specs(shapes, m, n))
        return mesh, lower, (NamedSharding(mesh, PartitionSpec(m, n)), NamedSharding(mesh, PartitionSpec())), args

    def aux(shape, rows):
        return f"{rows} w{rows}" if len(shape) == 2 else ("" if not shape else f"z{rows}")

    a_aux, b_aux, bias = shapes[2], shapes[5], shapes[6]
    rule = f"m ka, m sa, {aux(a_aux, 'm')}, n kb, n sb, {aux(b_aux, 'n')}, {'n' if bias[0] else 'zc'} -> m n, "
    # K and the scale / window columns are never sharded: every shard holds the whole contraction of its rows
    # (in the order the factors first appear in the rule, as Shardy requires)
    replicated = tuple(f for f in ("ka", "sa", "wm", "kb", "sb", "wn") if f in rule.replace(",", " ").split())
    f.def_partition(partition=part, infer_sharding_from_operands=infer, sharding_rule=rule,
                    need_replication_factors=replicated)
    return f


def gemm(prim, params, avals_in, avals_out, devices):
    """`jf4_gemm`'s partition function (`partitioning_base.register_lowerings`)."""
    return _gemm_cp(prim, params, avals_in)
