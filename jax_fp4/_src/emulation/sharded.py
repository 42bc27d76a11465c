"""The cross-shard sums of an emulated GEMM whose contracting dimension a mesh shards (`jax_fp4.dense`,
`jax_fp4.distributed`): `custom_partitioning` functions of the exact operands, so they see the shardings that
propagation gave their operands and need no mesh or PartitionSpec from the caller. On one device, inside shard_map
and where the contraction is not sharded they inline the unsharded product: the result is unchanged bit for bit.

  * `reduced_product(va, vb, ta, tb, dn, out_dtype)`: `exact_product` (the emulated GEMM: float32 dot of exact
    operands, then the NVFP4 tensor scales) of 2-D operands with one contracting dimension each, float32 result.
    Where the contracting dimension is sharded, each shard's partial product is multiplied by the tensor scales and
    rounded to `out_dtype` first, and the partial products are summed across shards in `out_dtype` (`lax.psum`;
    `lax.psum_scatter` over the mesh axes that shard the result along a free dimension, the FSDP weight gradient):
    the bytes of a bfloat16 GEMM's reduction, not float32's. The result is converted back to float32, so the caller
    adds the bias and casts as before (a second rounding of a bfloat16 value to bfloat16 changes nothing).
  * `narrow_product(va, vb, dn, out_dtype, sum_dtype)`: the bfloat16-output dot of unscaled exact operands that
    `jax_fp4.dense` runs on cuBLAS on CUDA devices, its cross-shard sum in float32 (the default rule: XLA alone would
    round each shard's bfloat16 partial product first) or in out_dtype (reduce_dtype="output").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp4._src.emulation.product import exact_product
from jax_fp4._src.primitives.partitioning_base import (
    axis_names,
    divisible_spec,
    entry_names,
    mesh_size,
    spec_entry,
    spec_of,
)

__all__ = ["narrow_product", "reduced_product"]


def _product(va, vb, ta, tb, dn):
    return exact_product(((va, ta), (vb, tb)), dn)


def reduced_product(va, vb, ta, tb, dimension_numbers, out_dtype):
    """float32 `exact_product(((va, ta), (vb, tb)), dimension_numbers)`, its cross-shard sum taken in `out_dtype`.

    Args:
      va, vb: 2-D exact operands (bfloat16 or float32 values, `jax_fp4._src.primitives.gemm.exact_operand`), one
        contracting dimension each, no batch dimensions (the three GEMMs of `jax_fp4.dense`).
      ta, tb: float32 scalar tensor scales or None.
      dimension_numbers: (((ca,), (cb,)), ((), ())).
      out_dtype: the dtype the caller casts the product to (the GEMM's output dtype, e.g. bfloat16).

    Returns:
      float32 [a free, b free]. Unsharded (or contracting dimension unsharded): `exact_product` bit for bit.
      Contracting dimension sharded over mesh axes S: sum over the shards s of out_dtype(P_s * ta * tb), P_s the
      shard's float32 partial product, summed in out_dtype by the collective (docs/numerics.md, "Distributed
      training"). Under vmap (`jax_fp4.dot_general`'s batch axes) the float32 `exact_product` of each batch
      element, its cross-shard sums left to XLA (float32).
    """
    def local(a, b, *ts):
        it = iter(ts)
        return _product(a, b, next(it) if ta is not None else None, next(it) if tb is not None else None,
                        dimension_numbers)

    scales = [t for t in (ta, tb) if t is not None]
    return _sharded_product(va, vb, scales, dimension_numbers, jnp.float32, local, local, jnp.dtype(out_dtype))


def narrow_product(va, vb, dimension_numbers, out_dtype, sum_dtype=jnp.float32):
    """`lax.dot_general(va, vb, dimension_numbers, preferred_element_type=out_dtype)` of unscaled exact operands
    (cuBLAS accumulates in float32 and rounds once to out_dtype), its cross-shard sum taken in `sum_dtype`.

    XLA alone would partition a dot with a bfloat16 result into per-shard bfloat16 dots and a bfloat16 all-reduce,
    which rounds each shard's partial product. Here a sharded contraction sums in sum_dtype: float32 (the default
    rule of docs/numerics.md, "Distributed training": the float32 `exact_product` per shard, `lax.psum` /
    `lax.psum_scatter` in float32, one cast) or out_dtype (reduce_dtype="output": each shard's narrow dot, summed in
    out_dtype, as `reduced_product`). Unsharded (or contracting dimension unsharded): the narrow dot.

    Args:
      va, vb: 2-D exact operands of one dtype, one contracting dimension each, no batch dimensions.
      dimension_numbers: (((ca,), (cb,)), ((), ())).
      out_dtype: the result dtype (bfloat16 or float16).
      sum_dtype: float32 or out_dtype.

    Returns:
      out_dtype [a free, b free]. Under vmap: per batch element, the float32 `exact_product` cast to out_dtype
      (sum_dtype float32) or the narrow dot (sum_dtype out_dtype), its cross-shard sums left to XLA.
    """
    out_dtype, sum_dtype = jnp.dtype(out_dtype), jnp.dtype(sum_dtype)

    def local(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=out_dtype)

    def partial(a, b):
        return local(a, b) if sum_dtype == out_dtype else _product(a, b, None, None, dimension_numbers)

    return _sharded_product(va, vb, [], dimension_numbers, out_dtype, local, partial, sum_dtype)


def _sharded_product(va, vb, scales, dimension_numbers, result_dtype, local, partial, sum_dtype):
    """A 2-D product as a `custom_partitioning` function of (va, vb, *scales): `local(a, b, *scales)` where the
    contracting dimension is not sharded (and on one device), else each shard's `partial(a, b, *scales)` converted
    to sum_dtype, summed across the shards in sum_dtype (psum_scatter over the axes that shard the wanted
    result along a free dimension, psum over the rest) and cast to result_dtype. Under vmap: `jax.vmap(partial)`
    cast to result_dtype, partitioned by XLA."""
    (ca, cb), _ = dimension_numbers
    (ca,), (cb,) = ca, cb
    fa, fb = 1 - ca, 1 - cb

    @custom_vmap
    def v(a, b, *ts):
        return f(a, b, *ts)

    @v.def_vmap
    def _batched(axis_size, in_batched, a, b, *ts):
        # under vmap (dot_general's batch axes): XLA's float32 partial sums (`partial` per batch element)
        args = [x if on else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, on in zip((a, b, *ts), in_batched, strict=True)]
        return jax.vmap(partial)(*args).astype(result_dtype), True

    @custom_partitioning
    def f(a, b, *ts):
        return local(a, b, *ts)

    def plan(mesh, arg_shapes, result_spec):
        sa = divisible_spec(mesh, arg_shapes[0].shape, spec_of(arg_shapes[0].sharding, 2))
        sb = divisible_spec(mesh, arg_shapes[1].shape, spec_of(arg_shapes[1].sharding, 2))
        k = sa[ca] if sa[ca] is not None else sb[cb]
        used = set(entry_names(k))
        m = sa[fa] if not set(entry_names(sa[fa])) & used else None
        used |= set(entry_names(m))
        n = sb[fb] if not set(entry_names(sb[fb])) & used else None
        # the contracting axes that shard the wanted result along a free dimension left unsharded: reduce-scatter
        scatter = [None, None]
        want = tuple(result_spec) + (None,) * (2 - len(tuple(result_spec)))
        for d, cur in ((0, m), (1, n)):
            names = entry_names(want[d])
            if cur is None and names and set(names) <= set(entry_names(k)) and not (set(names) & set(scatter[0] or ())):
                size = (arg_shapes[0].shape[fa], arg_shapes[1].shape[fb])[d]
                if size % mesh_size(mesh, tuple(names)) == 0:
                    scatter[d] = tuple(names)
        a_spec = [None, None]
        a_spec[ca], a_spec[fa] = k, m
        b_spec = [None, None]
        b_spec[cb], b_spec[fb] = k, n
        out = (m if scatter[0] is None else spec_entry(scatter[0]), n if scatter[1] is None else spec_entry(scatter[1]))
        return k, tuple(a_spec), tuple(b_spec), scatter, out

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec(*plan(mesh, arg_shapes, ())[4]))

    def part(mesh, arg_shapes, result_shape):
        want = spec_of(getattr(result_shape, "sharding", None), 2)
        k, a_spec, b_spec, scatter, out = plan(mesh, arg_shapes, want)
        k_axes = axis_names((k,))

        def lower(a, b, *ts):
            if not k_axes:
                return local(a, b, *ts)
            y = partial(a, b, *ts).astype(sum_dtype)
            rest = list(k_axes)
            for d, g in enumerate(scatter):
                if g:
                    y = jax.lax.psum_scatter(y, g if len(g) > 1 else g[0], scatter_dimension=d, tiled=True)
                    rest = [x for x in rest if x not in g]
            if rest:
                y = jax.lax.psum(y, tuple(rest))
            return y.astype(result_dtype)

        rep = NamedSharding(mesh, PartitionSpec())
        args = (NamedSharding(mesh, PartitionSpec(*a_spec)), NamedSharding(mesh, PartitionSpec(*b_spec)),
                *(rep for _ in scales))
        return mesh, lower, NamedSharding(mesh, PartitionSpec(*out)), args

    a_f = ["ka", "m"] if ca == 0 else ["m", "ka"]
    b_f = ["ka", "n"] if cb == 0 else ["n", "ka"]
    rule = ", ".join([" ".join(a_f), " ".join(b_f), *("" for _ in scales)]) + " -> m n"
    f.def_partition(partition=part, infer_sharding_from_operands=infer, sharding_rule=rule, reduction_factors=("ka",))
    return v(va, vb, *scales)
