"""Block-scaled format specs: `NVFP4` and `MXFP8` (docs/numerics.md sections 1-3).

A format spec is a frozen, hashable value (usable as a `jax.jit` static argument). It owns every fact about its
format — block size, code and scale dtypes, max values, scale shapes (compact / padded / GEMM-swizzled) and input
validation — so no other module writes a block size or a 448.

Orientation. `axis` is the *block axis*: the axis along which consecutive elements share a block scale.
- NVFP4 stores data with the block axis moved last (`jnp.moveaxis(x, axis, -1)`): for a 2-D x[M, K], axis=-1 is
  the rowwise quantization (data [M, K]) and axis=0 the columnwise one, stored as the rowwise quantization of x.T
  (data [K, M]).
- MXFP8 keeps x's shape for the data; scales have x's shape with the block axis divided by 32 (rowwise
  [M, K/32], columnwise [M/32, K]).
Scale matrices are viewed 2-D for padding and swizzling: rows = all non-block axes (in data order), columns = the
block axis's scale count. MXFP8 columnwise scales [M/32, K] are thus viewed as [K, M/32] (docs/numerics.md section 3).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from jax_fp4._src.ffi_codes import Kind

__all__ = ["NVFP4", "MXFP8", "Format", "SCALE_TILE_ROWS", "SCALE_TILE_COLS", "round_up", "ArgumentTypeError"]

SCALE_TILE_ROWS = 128  # cuBLAS block-scale layout: 128x4 tiles of scales, 512 bytes each
SCALE_TILE_COLS = 4
_FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (e.g. axis=None): a TypeError that is also a ValueError, since jax_fp4 reports
    bad input as ValueError everywhere else and callers catch that."""


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Format:
    """Base of the format specs: keyword options with defaults, frozen, hashable, compared by value."""

    _options: ClassVar[dict[str, Any]] = {}
    name: ClassVar[str] = "?"
    block_size: ClassVar[int]
    data_dtype: Any
    scale_dtype: ClassVar[Any]

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self._options))
        if unknown:
            raise ValueError(f"{self.name}: unknown option(s) {unknown}; known options: {sorted(self._options)}")
        values = {**self._options, **options}
        for k, v in values.items():
            object.__setattr__(self, k, self._normalize(k, v))
        self._validate()

    def _normalize(self, key, value):
        if isinstance(self._options[key], bool):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{self.name}: option {key} must be a bool, got {value!r}")
            return bool(value)
        return value

    def _validate(self):
        pass

    def __setattr__(self, key, value):
        raise AttributeError(f"{self.name} is frozen")

    def _key(self):
        return (type(self).__name__,) + tuple(getattr(self, k) for k in self._options)

    def __eq__(self, other):
        return isinstance(other, Format) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        opts = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._options if getattr(self, k) != self._options[k])
        return f"{self.name}({opts})"

    def replace(self, **options):
        return type(self)(**{**{k: getattr(self, k) for k in self._options}, **options})

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def max_value(self) -> float:
        """Largest finite data magnitude."""
        return float(jnp.finfo(self.data_dtype).max)

    def normalize_axis(self, shape, axis: int) -> int:
        """The block axis as a negative index (robust to leading batch dims); raises on a bad axis."""
        nd = len(shape)
        if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
            raise ArgumentTypeError(f"{self!r}: the block axis must be an int (e.g. -1 rowwise, 0 columnwise of a 2-D "
                                    f"x), got {type(axis).__name__} {axis!r} for shape {tuple(shape)}")
        axis = int(axis)
        if nd == 0:
            raise ValueError(f"{self!r}: cannot quantize a rank-0 array (shape {tuple(shape)}); it needs a block axis")
        if not -nd <= axis < nd:
            raise ValueError(f"{self!r}: block axis {axis} out of range for shape {tuple(shape)}")
        return axis % nd - nd

    def validate(self, shape, dtype, axis: int) -> int:
        """Checks that x (shape, dtype) can be quantized along `axis`; returns the normalized (negative) axis.

        Raises:
          ValueError naming the shape, dtype and format when the dtype is not bfloat16/float16/float32, the rank is
          0, or a blocked dimension is not a multiple of its block.
        """
        dtype = jnp.dtype(dtype)
        if dtype not in _FLOAT_INPUTS:
            raise ValueError(
                f"{self!r}: input must be bfloat16, float16 or float32, got {dtype} with shape {tuple(shape)}"
            )
        axis = self.normalize_axis(shape, axis)
        n = shape[axis]
        if n % self.block_size:
            raise ValueError(
                f"{self!r}: block axis {axis} of shape {tuple(shape)} has length {n}, "
                f"not a multiple of the block size {self.block_size}"
            )
        self._validate_shape(tuple(shape), axis)
        return axis

    def _validate_shape(self, shape, axis):
        pass

    def data_shape(self, shape, axis: int) -> tuple[int, ...]:
        """Shape of the quantized data for x of `shape` quantized along `axis`."""
        raise NotImplementedError

    def scale_shape(self, shape, axis: int) -> tuple[int, ...]:
        """Compact block-scale shape (row-major, matching the data) for x of `shape` along `axis`."""
        raise NotImplementedError

    def scale_matrix_shape(self, shape, axis: int) -> tuple[int, int]:
        """The compact scales viewed 2-D as [rows, scale columns] for padding/swizzling."""
        raise NotImplementedError

    def padded_scale_shape(self, shape, axis: int) -> tuple[int, int]:
        """[round_up(rows, 128), round_up(cols, 4)]: the scale matrix padded to whole 128x4 tiles."""
        r, c = self.scale_matrix_shape(shape, axis)
        return round_up(r, SCALE_TILE_ROWS), round_up(c, SCALE_TILE_COLS)

    def swizzled_scale_shape(self, shape, axis: int) -> tuple[int, int]:
        """GEMM-swizzled scales keep the padded 2-D shape; only the element order changes (docs/numerics.md s3)."""
        return self.padded_scale_shape(shape, axis)

    stores_block_axis_last: ClassVar[bool] = False

    # ---- format questions -----------------------------------------------------------------------------------
    # The NVFP4 options read False on every other format, so callers ask `fmt.rht` rather than the format's type.
    scaling_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    local_1x64: bool = False
    use_4over6: bool = False

    @property
    def kind_code(self) -> int:
        """The format's `Kind` code in the kernels' FFI attributes (jax_fp4/_src/ffi_codes.py)."""
        raise NotImplementedError

    @property
    def has_tensor_amax(self) -> bool:
        """Encodes with an fp32 tensor amax (NVFP4 1D/2D/RHT): an amax pass precedes the quantize, the
        QuantizedArray carries it, and a GEMM multiplies its result by the tensor scale amax * fp32(1/2688)
        (amax * fp32(1/1536) for NVFP4 on the 256 bound, `NVFP4.global_e4m3_max`)."""
        return False

    @property
    def needs_key(self) -> bool:
        """Quantizing needs a PRNG key (stochastic rounding)."""
        return self.stochastic_rounding

    @property
    def exact_operand_ok(self) -> bool:
        """The block scales factor out of a GEMM's sum, so value(q) * block scale is the exact bfloat16 operand of
        the emulated GEMM (`jax_fp4.gemm.ExactOperand`); False for NVFP4 1x64, whose window scales do not."""
        return not self.local_1x64


class NVFP4(Format):
    """NVFP4: E2M1 values in 1x16 blocks with E4M3 block scales and an fp32 tensor amax (docs/numerics.md s1).

    Options (all keyword, default False):
      scaling_2d: one block scale per 16x16 tile (weights), stored broadcast in the 1x16 layout. Needs the
        flattened non-block axes to be a multiple of 16 too.
      rht: random Hadamard transform of each 16-chunk along the block axis before amax and quantization
        (the wgrad operands). Dequantize applies the inverse.
      stochastic_rounding: round values stochastically (gradients); `quantize` then needs a PRNG key.
      local_1x64: the 1x64 local encode (TE PR #2941): one encode scale per 1x64 window instead of the tensor
        scale; needs both the block axis and the flattened other axes to be multiples of 64; excludes the others.
      use_4over6: "Four Over Six" adaptive block scaling (TE `nvfp4_4over6`, PR #2972; arXiv 2512.02010): every
        1x16 block (16x16 tile with scaling_2d) is encoded twice, with its amax mapped to 6 (the plain block scale)
        and to 4 (the block scale times 1.5), and keeps the candidate whose reconstruction has the smaller error
        (ties: map-to-6). Forward operands only in TE: excludes rht, stochastic_rounding and local_1x64.
      e4m3_max: the E4M3 bound the tensor scale is built on (TE `nvfp4_e4m3_max`): S_enc = 6 * e4m3_max / amax and
        the decode / GEMM tensor scale amax / (6 * e4m3_max). None (default): 256 with use_4over6 (TE's default
        `nvfp4_4over6_e4m3_use_256="all"`, which leaves room for the x1.5 map-to-4 scale), else 448. 256 needs
        use_4over6 (TE: "Non-4over6 NVFP4 quantization requires E4M3 max 448").
      err_mode_4over6: the candidate error of use_4over6 (TE `nvfp4_4over6_err_mode`): "MAE" (default, sum of
        |x_hat - x|) or "MSE" (sum of (x_hat - x)^2), in TE's exact fp32 order (docs/numerics.md section 1).

    Data: float4_e2m1fn, the block axis stored last (packed two per byte on GPU, element 2j in the low nibble).
    Scales: float8_e4m3fn [..., n/16]. Tensor amax: float32 scalar (1x64: window amax float32 [..., n/64]).
    """

    name = "NVFP4"
    _options = {"scaling_2d": False, "rht": False, "stochastic_rounding": False, "local_1x64": False,
                "use_4over6": False, "e4m3_max": None, "err_mode_4over6": "MAE"}
    block_size = 16
    data_dtype = jnp.float4_e2m1fn
    scale_dtype = jnp.float8_e4m3fn
    stores_block_axis_last = True
    window_size = 64
    scale_max = 448.0  # largest E4M3 block scale
    tile_2d = 16

    def _normalize(self, key, value):
        if key == "e4m3_max":
            if value is not None and (isinstance(value, (bool, np.bool_)) or value not in (256, 448)):
                raise ValueError(f"NVFP4: e4m3_max must be None, 256 or 448 (TE nvfp4_e4m3_max), got {value!r}")
            return None if value is None else int(value)
        if key == "err_mode_4over6":
            mode = value.upper() if isinstance(value, str) else value
            if mode not in ("MAE", "MSE"):
                raise ValueError(f"NVFP4: err_mode_4over6 must be 'MAE' or 'MSE' (TE nvfp4_4over6_err_mode), "
                                 f"got {value!r}")
            return mode
        return super()._normalize(key, value)

    def _validate(self):
        if self.use_4over6 and (self.rht or self.stochastic_rounding or self.local_1x64):
            raise ValueError(f"{self!r}: use_4over6 excludes rht, stochastic_rounding and local_1x64 (TE applies "
                             "4over6 to forward operands only: its 4over6 quantize refuses stochastic rounding, and "
                             "4over6 with RHT is not implemented there)")
        if self.e4m3_max == (256 if self.use_4over6 else 448):  # the default bound: one spelling, one hash
            object.__setattr__(self, "e4m3_max", None)
        if self.e4m3_max == 256 and not self.use_4over6:
            raise ValueError(f"{self!r}: e4m3_max=256 needs use_4over6=True (TE: non-4over6 NVFP4 quantization "
                             "requires E4M3 max 448)")
        if self.local_1x64 and (self.scaling_2d or self.rht or self.stochastic_rounding):
            raise ValueError(f"{self!r}: local_1x64 excludes scaling_2d, rht and stochastic_rounding (TE PR #2941)")
        if self.scaling_2d and self.rht:
            raise ValueError(f"{self!r}: 2D scaling is for weights and RHT for wgrad operands; pick one")

    @property
    def max_value(self) -> float:
        return 6.0

    @property
    def has_tensor_amax(self) -> bool:
        return not self.local_1x64

    @property
    def global_e4m3_max(self) -> int:
        """The E4M3 bound of the tensor scale (TE `nvfp4_e4m3_max`): 448, or 256 for use_4over6 unless e4m3_max
        says otherwise. S_enc = 6 * global_e4m3_max / amax; the decode and GEMM tensor scale is
        amax * fp32(1 / (6 * global_e4m3_max))."""
        if self.e4m3_max is not None:
            return self.e4m3_max
        return 256 if self.use_4over6 else 448

    @property
    def kind_code(self) -> int:
        return Kind.NVFP4

    def _validate_shape(self, shape, axis):
        rows = _prod_except(shape, axis)
        if self.local_1x64:
            if shape[axis] % self.window_size or rows % self.window_size:
                raise ValueError(
                    f"{self!r}: 1x64 local encode needs the block axis ({shape[axis]}) and the flattened other axes "
                    f"({rows}) to be multiples of 64; got shape {shape}, axis {axis}"
                )
        if self.scaling_2d and rows % self.tile_2d:
            raise ValueError(
                f"{self!r}: 2D scaling needs the flattened non-block axes ({rows}) to be a multiple of 16 as well; "
                f"got shape {shape}, axis {axis}"
            )

    def data_shape(self, shape, axis):
        shape = list(shape)
        n = shape.pop(axis)
        return tuple(shape) + (n,)

    def scale_shape(self, shape, axis):
        d = self.data_shape(shape, axis)
        return d[:-1] + (d[-1] // self.block_size,)

    def window_amax_shape(self, shape, axis):
        """1x64 window amax shape: the data shape with the block axis divided by 64."""
        d = self.data_shape(shape, axis)
        return d[:-1] + (d[-1] // self.window_size,)

    def scale_matrix_shape(self, shape, axis):
        s = self.scale_shape(shape, axis)
        return math.prod(s[:-1]), s[-1]


class MXFP8(Format):
    """MXFP8: E4M3 or E5M2 values in 1x32 blocks with E8M0 (power-of-two) scales (docs/numerics.md s2).

    Options:
      element: "e4m3" (default, max 448) or "e5m2" (max 57344). A jnp dtype is accepted too.

    Data: float8_e4m3fn / float8_e5m2 with x's shape. Scales: float8_e8m0fnu with x's shape, block axis / 32.
    """

    name = "MXFP8"
    _options = {"element": "e4m3"}
    block_size = 32
    scale_dtype = jnp.float8_e8m0fnu
    _ELEMENTS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}

    def _normalize(self, key, value):
        if key == "element":
            given = value
            if not isinstance(value, str):
                try:
                    dt = jnp.dtype(value) if value is not None else None  # (jnp.dtype(None) is float64)
                except TypeError as e:
                    raise ValueError(f"MXFP8: element must be 'e4m3' or 'e5m2', got {value!r}") from e
                value = {jnp.dtype(v): k for k, v in self._ELEMENTS.items()}.get(dt, str(dt))
            if value not in self._ELEMENTS:
                raise ValueError(f"MXFP8: element must be 'e4m3' or 'e5m2', got {given!r}")
        return value

    @property
    def data_dtype(self):
        return self._ELEMENTS[self.element]

    @property
    def kind_code(self) -> int:
        return Kind.MXFP8_E4M3 if self.element == "e4m3" else Kind.MXFP8_E5M2

    def data_shape(self, shape, axis):
        return tuple(shape)

    def scale_shape(self, shape, axis):
        s = list(shape)
        s[axis] //= self.block_size
        return tuple(s)

    def scale_matrix_shape(self, shape, axis):
        s = self.scale_shape(shape, axis)
        cols = s[axis]
        return _prod_except(s, axis), cols


def _prod_except(shape, axis):
    return math.prod(d for i, d in enumerate(shape) if i != axis % len(shape))
