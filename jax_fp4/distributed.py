"""Quantized GEMMs on a device mesh: FSDP weight gathers of codes and block scales, and cross-shard sums of partial
GEMM products in the output dtype (docs/numerics.md, "Distributed training").

`jax_fp4.dense` (and everything built on it: `dot_general`, the Flax layers, `make_dot_general`) takes its
distributed options from the recipe, so a model picks them up without new arguments:

    recipe = jax_fp4.distributed.shard_recipe(recipes.NVFP4Fwd_MXFP8Bwd(), fsdp_axes="fsdp", reduce_dtype="output")

  * fsdp_axes: mesh axes over which the kernels arrive sharded (FSDP: e.g. kernel P("fsdp", None) or
    P(None, "fsdp"), any dimension, alongside tensor-parallel axes). Each shard quantizes its own slice of the
    kernel (whole blocks, 16x16 tiles, 1x64 windows: the quantize sharding rule; the NVFP4 tensor amax is reduced
    across shards with `lax.pmax` as always), and the quantized weight's codes, block scales and 1x64 window amaxes
    are all-gathered over these axes (`gather_quantized`) just before the GEMM consumes them, in the forward pass
    (fprop operand) and again in the backward pass (the dgrad operand: the saved residual stays sharded). The
    bfloat16 weight never crosses the wire. Results equal the unsharded ones bit for bit: the codes are those of the
    unsharded quantize. A kernel whose shards would split a block is gathered before its quantize instead (the
    quantize rule's fallback), with the same bits. Unquantized operands (BF16, or a recipe operand set to None)
    are left to XLA.
  * reduce_dtype: "float32" (default: XLA sums the float32 partial products across shards; the sums of the exact
    block-scaled products are order-independent, so data / tensor / FSDP-parallel results equal the unsharded ones
    bit for bit, at twice a bfloat16 reduction's bytes) or "output": each shard's partial product of an emulated
    GEMM whose contraction is sharded (the weight gradient under data parallelism and FSDP, the row-parallel fprop
    and column-parallel dgrad under tensor parallelism) is rounded to the GEMM's output dtype (the dtype of the
    kernel / x handed to `dense`, e.g. bfloat16) before the cross-shard sum, which runs in that dtype (all-reduce,
    or reduce-scatter where the gradient is wanted sharded): the bytes of the bfloat16 step. Results then differ
    from the unsharded ones by the roundings of the partial sums (bound in docs/numerics.md).

On one device both options change nothing (bit for bit). The `jf4_gemm` kernel route keeps its own sharding rule
(K gathered: `jax_fp4/_src/primitives/partitioning_gemm.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_fp4._src.emulation.sharded import reduced_product
from jax_fp4._src.primitives.partitioning_collective import gather_axes
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.recipes import Recipe, resolve

__all__ = ["REDUCE_DTYPES", "ShardedRecipe", "gather_quantized", "reduced_product", "shard_recipe"]

#: `ShardedRecipe.reduce_dtype` choices.
REDUCE_DTYPES = ("float32", "output")


@dataclasses.dataclass(frozen=True)
class ShardedRecipe(Recipe):
    """A `Recipe` with distributed options (module docstring); hashable, a valid static argument of `jax.jit`.

    Fields (besides the six operand formats and the name of the recipe it wraps):
      fsdp_axes: tuple of mesh axis names the kernels are FSDP-sharded over (() : none).
      reduce_dtype: "float32" or "output" (REDUCE_DTYPES).
    """

    fsdp_axes: tuple = ()
    reduce_dtype: str = "float32"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.fsdp_axes, tuple) or not all(isinstance(a, str) for a in self.fsdp_axes):
            raise TypeError(f"ShardedRecipe {self.name}: fsdp_axes must be a tuple of mesh axis names, got "
                            f"{self.fsdp_axes!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"ShardedRecipe {self.name}: reduce_dtype must be one of {REDUCE_DTYPES}, got "
                             f"{self.reduce_dtype!r}")


def shard_recipe(recipe, *, fsdp_axes=(), reduce_dtype: str = "float32") -> ShardedRecipe:
    """`recipe` (a Recipe or its name) with distributed options (module docstring).

    Args:
      recipe: a `jax_fp4.recipes.Recipe` (or a ShardedRecipe, whose options are replaced) or a recipe name.
      fsdp_axes: a mesh axis name or a tuple of them: the axes the kernels handed to `dense` are sharded over for
        FSDP; their quantized codes and scales are all-gathered over these axes.
      reduce_dtype: "float32" (default, exact) or "output" (partial GEMM products summed across shards in the
        GEMM's output dtype).

    Raises:
      TypeError: a recipe that is neither a Recipe nor a name; fsdp_axes not names.
      ValueError: an unknown recipe name or reduce_dtype.
    """
    recipe = resolve(recipe, "shard_recipe")
    axes = (fsdp_axes,) if isinstance(fsdp_axes, str) else tuple(fsdp_axes)
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(Recipe)}
    return ShardedRecipe(**fields, fsdp_axes=axes, reduce_dtype=reduce_dtype)


def fsdp_axes(recipe) -> tuple:
    """The FSDP mesh axes of a recipe (() for a plain Recipe)."""
    return getattr(recipe, "fsdp_axes", ())


def reduces_in_output_dtype(recipe) -> bool:
    """Whether a recipe sums partial GEMM products across shards in the output dtype (reduce_dtype="output")."""
    return getattr(recipe, "reduce_dtype", "float32") == "output"


def gather_quantized(q, axes):
    """q with its codes, block scales and 1x64 window amaxes all-gathered over the mesh axes `axes`.

    Args:
      q: a QuantizedArray (e.g. the quantization of a kernel sharded over `axes`); the scalar tensor amax is
        replicated already. Anything else (an unquantized operand) is returned as is.
      axes: a mesh axis name or a tuple of them (`gather_axes`).

    Returns:
      The same QuantizedArray (same fields, bit for bit), its leaves no longer sharded over `axes`.
    """
    if not axes or not isinstance(q, QuantizedArray):
        return q

    def g(a):
        return None if a is None else _from_wire(gather_axes(_to_wire(a), axes), a.dtype)

    return QuantizedArray(g(q.data), g(q.scale), q.amax, g(q.window_amax), fmt=q.fmt, axis=q.axis,
                          scale_layout=q.scale_layout)


def _to_wire(a):
    """The bytes a gather moves: 1-byte codes and scales (float8 / E8M0) as uint8; 4-bit codes (E2M1) as uint8
    pairs along the last axis, element 2j in the low nibble (the last axis is the NVFP4 block axis: even on every
    shard). Other dtypes unchanged. Backends that do not move 8-bit floats or 4-bit types natively (XLA:CPU
    widens them) then still move 1 byte per byte."""
    if jnp.dtype(a.dtype) == jnp.dtype(jnp.float4_e2m1fn):
        if not a.ndim or a.shape[-1] % 2:
            return a
        u = jax.lax.bitcast_convert_type(a, jnp.uint4).astype(jnp.uint8)
        return u[..., 0::2] | (u[..., 1::2] << 4)
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    return a


def _from_wire(w, dtype):
    """Inverse of `_to_wire` for an array of `dtype`."""
    if w.dtype == jnp.dtype(dtype):
        return w
    if jnp.dtype(dtype) == jnp.dtype(jnp.float4_e2m1fn):
        u = jnp.stack([w & 15, w >> 4], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
        return jax.lax.bitcast_convert_type(u.astype(jnp.uint4), dtype)
    return jax.lax.bitcast_convert_type(w, dtype)

