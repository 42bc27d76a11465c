"""`QuantizedArray`: the pytree every quantize returns and every dequantize / GEMM consumes; `ExactOperand`: a
quantized tensor as the emulated GEMM consumes it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fp4.formats import Format

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

    Every field is checked against the format at construction (when the leaves are arrays, tracers or
    ShapeDtypeStructs; leaves such as vmap axis specs or float0 tangents are not) and again by `dequantize` and
    `scaled_dot_general` (`validate`): dtypes, the scale shape implied by the data shape, axis and layout, the
    NVFP4 tensor amax (required: without it the tensor scale would be dropped) and the 1x64 window amax. Leading
    axes that vmap / scan add to every leaf are accepted.
    """

    data: jax.Array
    scale: jax.Array
    amax: jax.Array | None
    window_amax: jax.Array | None
    fmt: Format = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    scale_layout: str = dataclasses.field(default="compact", metadata=dict(static=True))

    def __post_init__(self):
        if not isinstance(self.fmt, Format):
            raise TypeError(f"QuantizedArray: fmt must be a jax_fp4 Format, got {type(self.fmt).__name__} {self.fmt!r}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"QuantizedArray: scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")
        self.validate()

    def validate(self) -> QuantizedArray:
        """Checks every field against the format; returns self.

        Raises:
          ValueError naming the field, its dtype/shape and the expected one: data or scale of the wrong dtype; a
          block axis outside the data's rank or not a multiple of the block size; a scale shape that is not the
          compact (`fmt.scale_shape`) or swizzled (`fmt.swizzled_scale_shape`) shape of the data (e.g. transposed
          or reshaped scales); NVFP4 (1D/2D/RHT) without a float32 scalar amax; amax on a format without a tensor
          scale; a missing or misshapen 1x64 window amax.
          TypeError: a non-int axis.
        """
        if not _checkable(self):
            return self
        fmt, data, scale = self.fmt, self.data, self.scale
        where = f"QuantizedArray({fmt!r}, axis={self.axis}, {self.scale_layout})"
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"{where}: axis must be an int, got {type(self.axis).__name__}")
        if not -len(data.shape) <= self.axis < 0:
            raise ValueError(f"{where}: axis must be negative and within the data's rank {len(data.shape)}")
        for name, a, want in (("data", data, fmt.data_dtype), ("scale", scale, fmt.scale_dtype)):
            if jnp.dtype(a.dtype) != jnp.dtype(want):
                raise ValueError(f"{where}: {name} must be {jnp.dtype(want)}, got {a.dtype}{list(a.shape)}")
        shape = self.shape
        if shape[self.axis] % fmt.block_size:
            raise ValueError(f"{where}: block axis length {shape[self.axis]} of shape {shape} is not a multiple of "
                             f"{fmt.block_size}")
        if self.scale_layout == "compact":
            want = fmt.scale_shape(shape, self.axis)
            if tuple(scale.shape) != tuple(want):
                raise ValueError(f"{where}: compact scale must be {jnp.dtype(fmt.scale_dtype)}{list(want)} for data "
                                 f"{data.dtype}{list(data.shape)}, got {list(scale.shape)}")
        else:
            lead = len(scale.shape) - 2  # leading axes added by vmap / scan
            ok = lead >= 0 and len(shape) - lead >= -self.axis and tuple(scale.shape[:lead]) == shape[:lead]
            want = fmt.swizzled_scale_shape(shape[lead:], self.axis) if ok else None
            if not ok or tuple(scale.shape[lead:]) != tuple(want):
                raise ValueError(f"{where}: swizzled scale must be the padded 2-D matrix "
                                 f"{list(fmt.swizzled_scale_shape(shape, self.axis))} for data "
                                 f"{data.dtype}{list(data.shape)}, got {list(scale.shape)}")
        if fmt.has_tensor_amax:
            a = self.amax
            if a is None:
                raise ValueError(f"{where}: NVFP4 needs amax, the float32 tensor amax the data was encoded with "
                                 "(decode scale = block scale * amax / 2688); got None")
            if jnp.dtype(a.dtype) != jnp.float32 or len(a.shape) >= len(data.shape) or \
                    tuple(a.shape) != tuple(data.shape[:len(a.shape)]):
                raise ValueError(f"{where}: amax must be a float32 scalar (one per leading vmap axis), got "
                                 f"{a.dtype}{list(a.shape)} for data {list(data.shape)}")
        elif self.amax is not None:
            raise ValueError(f"{where}: {fmt!r} has no tensor amax; amax must be None, got "
                             f"{self.amax.dtype}{list(self.amax.shape)}")
        if fmt.local_1x64:
            w, want = self.window_amax, fmt.window_amax_shape(shape, self.axis)
            if w is None or jnp.dtype(w.dtype) != jnp.float32 or tuple(w.shape) != tuple(want):
                got = None if w is None else f"{w.dtype}{list(w.shape)}"
                raise ValueError(f"{where}: window_amax must be float32{list(want)} (the 1x64 window amaxes), got "
                                 f"{got}")
        elif self.window_amax is not None:
            raise ValueError(f"{where}: window_amax is for NVFP4(local_1x64=True) only; must be None")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the original (unquantized) array."""
        if self.fmt.stores_block_axis_last:
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


def _checkable(q) -> bool:
    """Whether q's leaves are arrays (or tracers / ShapeDtypeStructs) to check: data and scale array-like, amax and
    window_amax array-like or None, no float0 (tangent) leaf."""
    def arr(a):
        return hasattr(a, "shape") and hasattr(a, "dtype")

    leaves = (q.data, q.scale, q.amax, q.window_amax)
    if not (arr(q.data) and arr(q.scale) and all(a is None or arr(a) for a in leaves[2:])):
        return False
    return all(a is None or a.dtype != jax.dtypes.float0 for a in leaves)


def _moved_back(data_shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """Inverse of moving `axis` last: put the last dim back at position `axis` (negative index)."""
    s = list(data_shape)
    n = s.pop()
    pos = len(s) + 1 + axis
    s.insert(pos, n)
    return tuple(s)

