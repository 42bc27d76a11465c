"""`GroupedQuantizedArray`: N block-scaled tensors in contiguous buffers (docs/numerics.md section 4, TE
`GroupedTensor`).

The pytree `jax_fp4.grouped_quantize` returns and `jax_fp4.grouped_dequantize` / `jax_fp4.ragged_dot` consume.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jax_fp4.formats import Format
from jax_fp4.quantized_array import QuantizedArray
from jax_fp4.reference.grouped import GroupedQuantized
from jax_fp4.validation import Representation

__all__ = ["GroupedQuantizedArray", "Representation"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedQuantizedArray:
    """N quantized tensors x_g [M_g, K_g] of one format in one data buffer and one scale buffer.

    Representations (static; TE `common/common.h`), of the original buffer x:
      SAME_BOTH_DIMS     x [N*M, K]: N groups [M, K] (N static).
      VARYING_FIRST_DIM  x [sum M_g, K]: tokens grouped by expert (the MoE activations), first_dims = M_g.
      VARYING_LAST_DIM   x [M, sum K_g] (nominal: the groups [M, K_g] are stored one after the other).
      VARYING_BOTH_DIMS  x [L] flat.
    The groups may fill less than x (sum M_g K_g <= x.size; the rest is padding, code 0) and may be empty.

    Fields (pytree leaves; a vmapped array has a leading batch dim on each):
      data: [x.size], group g's data flattened at offsets[g]. NVFP4 float4_e2m1fn with the group's block axis last
        (rowwise: x_g row-major; columnwise: x_g.T row-major), packed two per byte on GPU, even index in the low
        nibble. MXFP8 float8_e4m3fn / float8_e5m2 in x_g's own row-major layout.
      scale: [x.size // block], group g's compact scales at offsets[g] // block: NVFP4 float8_e4m3fn [M_g, K_g/16]
        rowwise, [K_g, M_g/16] columnwise; MXFP8 float8_e8m0fnu [M_g, K_g/32] rowwise, [M_g/32, K_g] columnwise.
      amax: float32[N] per-group tensor amax (NVFP4; after the RHT for RHT formats), None for MXFP8.
      first_dims, last_dims: int32[N] group dims M_g, K_g (device arrays, possibly traced; static dims materialized).
      offsets: int32[N+1] element offsets, the exclusive cumsum of M_g K_g.
    Static fields: fmt, axis (-1 rowwise: blocks along each K_g; 0 columnwise: along each M_g), representation,
      shape (x's shape).

    Each group's data, scales and amax equal the single-tensor `jax_fp4.quantize(x_g, fmt, axis=axis)` bit for bit
    (with key fold_in(key, g) for stochastic rounding). A group whose block-axis length is not a whole number of
    blocks (possible only with traced sizes) is poisoned: NaN scales (and NaN MXFP8 data / NVFP4 amax).
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array | None
    first_dims: jax.Array
    last_dims: jax.Array
    offsets: jax.Array
    fmt: Format = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    representation: Representation = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def num_groups(self) -> int:
        return self.first_dims.shape[-1]

    @property
    def size(self) -> int:
        """Elements of the original buffer x."""
        return math.prod(self.shape)

    @property
    def scale_offsets(self) -> jax.Array:
        """int32[N+1]: where each group's scales start in `scale` (offsets // block size)."""
        return self.offsets // self.fmt.block_size

    def split(self) -> list[QuantizedArray | None]:
        """The N groups as single-tensor QuantizedArrays (group g: x_g [M_g, K_g] quantized along axis -1 or -2).

        Reads the group sizes on the host (a device-to-host copy): for inspection and tests, not for jitted code. A
        poisoned group (block-axis length not a whole number of blocks) has no single-tensor form: None.
        """
        rows, cols, off = (np.asarray(a) for a in (self.first_dims, self.last_dims, self.offsets))
        bs, out = self.fmt.block_size, []
        axis = -1 if self.axis == -1 else -2
        for g in range(self.num_groups):
            shape = (max(int(rows[g]), 0), max(int(cols[g]), 0))
            if shape[0 if axis == -2 else 1] % bs:
                out.append(None)
                continue
            data = self.data[off[g] : off[g + 1]].reshape(self.fmt.data_shape(shape, axis))
            scale = self.scale[off[g] // bs : off[g + 1] // bs].reshape(self.fmt.scale_shape(shape, axis))
            amax = self.amax[g] if self.fmt.has_tensor_amax else None
            out.append(QuantizedArray(data, scale, amax, None, fmt=self.fmt, axis=axis))
        return out

    def to_reference(self) -> GroupedQuantized:
        """The same buffers as a `jax_fp4.reference.GroupedQuantized`."""
        return GroupedQuantized(self.data, self.scale, self.amax, self.first_dims, self.last_dims, self.offsets,
                                self.fmt, self.axis, self.representation, self.shape)

    @classmethod
    def from_reference(cls, g: GroupedQuantized) -> GroupedQuantizedArray:
        return cls(g.data, g.scale, g.amax, g.first_dims, g.last_dims, g.offsets, fmt=g.fmt, axis=g.axis,
                   representation=g.representation, shape=tuple(g.x_shape))

    def __repr__(self) -> str:
        return (f"GroupedQuantizedArray({self.fmt!r}, {self.representation.value}, N={self.num_groups}, "
                f"shape={self.shape}, axis={self.axis}, data={self.data.dtype}{list(self.data.shape)}, "
                f"scale={self.scale.dtype}{list(self.scale.shape)})")
