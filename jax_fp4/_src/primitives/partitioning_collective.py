"""The explicit gather of a quantized weight's pieces under a mesh (`jax_fp4.distributed`, `jax_fp4.dense`).

`gather_axes` is a `custom_partitioning` function (a per-call rule, as `partitioning.py`'s), so it sees the
sharding that propagation gave its operand and needs no mesh or PartitionSpec from the caller. On one device and
inside shard_map it inlines its per-shard body, the identity. The cross-shard sums of an emulated GEMM's partial
products are `jax_fp4._src.emulation.sharded`.

  * `gather_axes(x, axes)`: every dimension of x sharded over a mesh axis named in `axes` is all-gathered over it
    (tiled, in mesh order) inside the per-shard body; the other mesh axes stay. Its Shardy rule links no factor of
    the operand to the result, so propagation neither pushes the gathered result's (replicated) sharding back onto
    the operand (which would gather the bfloat16 weight before its quantize) nor the operand's onto the result.
    Applied to the leaves of a QuantizedArray quantized from a sharded weight, the codes and block scales cross the
    wire, not the weight.
"""

from __future__ import annotations

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4._src.primitives.partitioning_base import divisible_spec, entry_names, spec_entry, spec_of

__all__ = ["gather_axes"]


def _split_entry(entry, gathered):
    """(kept, gathered) mesh axes of one PartitionSpec entry: from the first axis in `gathered` on (the minor
    axes, major first), every axis is gathered, so the kept axes are a major prefix and each gathered shard is the
    tiled concatenation of its peers."""
    names = entry_names(entry)
    cut = next((i for i, n in enumerate(names) if n in gathered), len(names))
    return names[:cut], names[cut:]


def gather_axes(x, axes):
    """x with its dimensions' shardings over the mesh axes `axes` (a name or a tuple of names) all-gathered.

    Args:
      x: any array; its sharding comes from propagation (e.g. a quantized weight's codes or block scales).
      axes: mesh axis names to gather; a dimension sharded over a tuple of axes also gathers the axes minor to the
        first gathered one (they would not tile otherwise).

    Returns:
      x, same shape, dtype and values; sharded only over the axes not gathered. Identity on one device. Under vmap
      the batch axis is one more dimension of x (gathered likewise where sharded over `axes`).
    """
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    if x.ndim == 0 or not axes or 0 in x.shape:
        return x

    @custom_vmap
    def g(a):
        return _gather(a, axes)

    @g.def_vmap
    def _batched(axis_size, in_batched, a):
        return gather_axes(a, axes), in_batched[0]

    return g(x)


def _gather(x, axes):
    nd = x.ndim

    @custom_partitioning
    def f(a):
        return a

    def specs(mesh, arg_shapes):
        spec = tuple(e if set(entry_names(e)) <= set(mesh.axis_names) else None
                     for e in divisible_spec(mesh, arg_shapes[0].shape, spec_of(arg_shapes[0].sharding, nd)))
        return spec, tuple(spec_entry(_split_entry(e, axes)[0]) for e in spec)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(*specs(mesh, arg_shapes)[1]))

    def part(mesh, arg_shapes, result_shape):
        spec, out = specs(mesh, arg_shapes)

        def lower(a):
            for d, e in enumerate(spec):
                g = _split_entry(e, axes)[1]
                if g:
                    a = jax.lax.all_gather(a, g if len(g) > 1 else g[0], axis=d, tiled=True)
            return a

        return (mesh, lower, NamedSharding(mesh, PartitionSpec(*out)),
                (NamedSharding(mesh, PartitionSpec(*spec)),))

    letters = "abcdefghijklm"[:nd]
    rule = f"{' '.join(letters)} -> {' '.join('z' + c for c in letters)}"
    f.def_partition(partition=part, infer_sharding_from_operands=infer, sharding_rule=rule)
    return f(x)
