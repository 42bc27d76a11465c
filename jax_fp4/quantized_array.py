"""`QuantizedArray`: the pytree every quantize returns and every dequantize / GEMM consumes; `ExactOperand`: a
quantized tensor as the emulated GEMM consumes it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from jax_fp4.formats import NVFP4, Format

__all__ = ["SCALE_LAYOUTS", "ExactOperand", "QuantizedArray"]

SCALE_LAYOUTS = ("compact", "swizzled")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-scaled tensor.

    Fields (pytree leaves):
      data: the codes. NVFP4: float4_e2m1fn with the block axis moved last (x[M, K] with axis=-1 -> [M, K];
        axis=0 -> [K, M], the rowwise quantization of x.T); packed two per byte on GPU, element 2j in the low
        nibble. MXFP8: float8_e4m3fn / float8_e5m2 with x's shape.
      scale: block scales. Compact: NVFP4 float8_e4m3fn [..., n/16] (data shape, last axis / 16); MXFP8
        float8_e8m0fnu with x's shape and the block axis / 32. Swizzled: the 2-D padded GEMM layout
        [round_up(rows, 128), round_up(cols, 4)] (docs/numerics.md section 3).
      amax: float32 scalar tensor amax (NVFP4 1D/2D/RHT: of the transformed tensor for RHT); None otherwise.
      window_amax: float32 [..., n/64] (NVFP4 1x64 only), else None.
    Static fields: fmt (the format spec), axis (block axis of the original x, negative), scale_layout.
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array | None
    window_amax: jax.Array | None
    fmt: Format = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    scale_layout: str = dataclasses.field(default="compact", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the original (unquantized) array."""
        if isinstance(self.fmt, NVFP4):
            return _moved_back(self.data.shape, self.axis)
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def compact_scale_shape(self) -> tuple[int, ...]:
        return self.fmt.scale_shape(self.shape, self.axis)

    def __repr__(self) -> str:
        return (f"QuantizedArray({self.fmt!r}, shape={self.shape}, axis={self.axis}, data={self.data.dtype}"
                f"{list(self.data.shape)}, scale={self.scale.dtype}{list(self.scale.shape)} {self.scale_layout})")


class ExactOperand(NamedTuple):
    """A quantized tensor as the emulated GEMM consumes it: dequantize(q) == values * tensor_scale.

    values: bfloat16 in the logical (x's) orientation, value(q) * block scale exactly (NVFP4 1D/2D/RHT with the RHT
    left in place, MXFP8); tensor_scale: float32 scalar amax * fp32(1/2688) for NVFP4, None for MXFP8. Produced by
    `exact_operand` from a QuantizedArray, or straight from the quantize pass
    (`quantize_rowwise_columnwise(..., exact=...)`), which saves the dequantize pass of the emulated GEMM.
    """

    values: jax.Array
    tensor_scale: jax.Array | None


def _moved_back(data_shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """Inverse of moving `axis` last: put the last dim back at position `axis` (negative index)."""
    s = list(data_shape)
    n = s.pop()
    pos = len(s) + 1 + axis
    s.insert(pos, n)
    return tuple(s)

