"""Public quantize / dequantize / scale-layout conversions (ops layer).

`quantize` and `quantize_rowwise_columnwise` view x as [P, M, K] around the block axis and bind the `jf4_quantize`
primitive (CUDA kernel where built, the bit-exact reference elsewhere), after an amax pass (`tensor_amax`, or
`rht_amax` for RHT operands) for formats with a tensor scale. `dequantize` binds `jf4_dequantize` on the
QuantizedArray's [P, R, C] view; `swizzle_scales` / `unswizzle_scales` bind `jf4_swizzle` / `jf4_unswizzle` on the
2-D scale matrix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4._src.primitives.dequantize import dequantize_array
from jax_fp4._src.primitives.quantize import quantize_3d
from jax_fp4._src.primitives.rht_amax import rht_amax
from jax_fp4._src.primitives.swizzle import compact_scales
from jax_fp4._src.primitives.swizzle import swizzle as _swizzle
from jax_fp4.formats import Format
from jax_fp4.quantized_array import SCALE_LAYOUTS, ExactOperand, QuantizedArray
from jax_fp4.reference import layout
from jax_fp4.reference.nvfp4 import tensor_decode_scale, window_nan
from jax_fp4.reference.sr import philox_key
from jax_fp4.validation import check_amax, check_key, check_quantize_inputs

__all__ = ["quantize", "quantize_rowwise_columnwise", "dequantize", "swizzle_scales", "unswizzle_scales"]

def _check_layout(scale_layout, x, fmt):
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(
            f"quantize: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r} "
            f"(x {jnp.result_type(x)}{list(jnp.shape(x))}, {fmt!r})"
        )


def _amax(x, x3, fmt, orientation, given=None):
    """float32[P]: the tensor amax an NVFP4 1D/2D/RHT orientation encodes with (zeros when unused); `given` (a
    finite float32 scalar from the caller, `_given_amax`) replaces the tensor-amax pass of a non-RHT orientation."""
    P = x3.shape[0]
    if fmt is None or not fmt.has_tensor_amax:
        return jnp.zeros((P,), jnp.float32)
    if P == 0:  # nothing to encode (and nothing to reduce over)
        return jnp.zeros((0,), jnp.float32)
    if fmt.rht:
        a = jnp.max(rht_amax(x3, orientation))
    else:
        a = tensor_amax(x) if given is None else given
    return jnp.broadcast_to(a, (P,))


def _given_amax(amax, x, where):
    """(finite amax, NaN flag) of a caller's `amax` = jnp.max(jnp.abs(x)): a float32 scalar (any float dtype is
    widened exactly); NaN means x holds a NaN (the flag `_has_nan` computes otherwise), and the encode then uses 0."""
    if amax is None:
        return None, None
    check_amax(amax, x, f"{where}: amax")
    a = jnp.asarray(amax).astype(jnp.float32)
    nan = jnp.isnan(a)
    return jnp.where(nan, jnp.float32(0), a), nan


def _key_words(fmt, key):
    if fmt is not None and fmt.needs_key:
        return philox_key(key)
    return jnp.zeros((2,), jnp.uint32)


def _scalar_amax(fmt, amax, nan=None):
    """The scalar tensor amax a QuantizedArray carries, from _amax's float32[P] (all equal; 0, the amax of nothing,
    when P == 0); NaN where `nan` (x holds a NaN, `_has_nan`): see `_has_nan`."""
    if fmt is None or not fmt.has_tensor_amax:
        return None
    a = amax[0] if amax.shape[0] else jnp.zeros((), jnp.float32)
    return a if nan is None else jnp.where(nan, jnp.float32(jnp.nan), a)


def _has_nan_flag(*fmts):
    """Whether a quantization of these formats carries the NaN flag (`_has_nan`): a tensor amax in one of them."""
    return any(f is not None and f.has_tensor_amax for f in fmts)


def _has_nan(x, *fmts):
    """bool scalar: x holds a NaN, for formats whose decode goes through a tensor amax (NVFP4 1D/2D/RHT), else None.

    The tensor amax ignores NaNs (fmaxf, TE's rule) and E2M1 has no NaN code (NaN encodes as +6), so an NVFP4
    tensor would lose a NaN of x. The encode keeps the finite amax (the codes and block scales are the kernel's, as
    TE writes them); the amax the QuantizedArray carries becomes NaN, so its dequantize and every GEMM product are NaN
    and a diverging run cannot look healthy. Cost: one extra reduction over x (an XLA fusion, not the CUDA kernels).
    ±inf needs nothing: the amax is inf and the decode scale inf.
    """
    if not _has_nan_flag(*fmts) or x.size == 0:
        return None
    # a float32 max (not a bool any): under sharding its cross-shard reduction is a float32 max all-reduce like
    # the amax's, which XLA combines into one collective (docs/numerics.md "Distributed training")
    return jnp.max(jnp.isnan(x).astype(jnp.float32)) > 0


def _wamax(fmt, w, shape, x, axis):
    """The 1x64 window amax a QuantizedArray carries (None for other formats): the kernel's, NaN for every window
    holding a NaN of x (`window_nan`), as `_has_nan` does for the tensor amax; the encode used the finite one."""
    if fmt is None or not fmt.local_1x64:
        return None
    return jnp.where(window_nan(x, axis), jnp.float32(jnp.nan), w.reshape(shape))


def quantize(x, fmt: Format, *, axis: int = -1, key=None, scale_layout: str = "compact") -> QuantizedArray:
    """Quantize `x` to the block-scaled format `fmt` along the block axis `axis`.

    Args:
      x: bfloat16, float16 or float32 array of rank >= 1 (empty allowed).
      fmt: `jax_fp4.NVFP4(...)` or `jax_fp4.MXFP8(...)`.
      axis: the block axis (consecutive elements along it share a scale). For x[M, K]: -1 = rowwise, 0 =
        columnwise (NVFP4 stores it as the rowwise quantization of x.T; MXFP8 keeps x's shape).
      key: JAX PRNG key; required by NVFP4(stochastic_rounding=True), ignored otherwise.
      scale_layout: "compact" (row-major, matching the data) or "swizzled" (padded 128x4-tile GEMM layout).

    Returns:
      QuantizedArray (see its docstring for every field's shape, dtype and packing).

    Raises:
      ValueError (at trace time, naming the shape, dtype and format): dtype not bfloat16/float16/float32; rank 0;
      x.shape[axis] % block_size != 0 (16 NVFP4, 32 MXFP8); NVFP4 scaling_2d with the flattened other axes
      % 16 != 0; local_1x64 with the block axis or the other axes % 64 != 0; stochastic rounding without `key`;
      an unknown scale_layout.

    Numerics: docs/numerics.md sections 1-3 (TE `core_nvfp4.cuh`, `quantize_mxfp8.cuh`), bit for bit on every platform.
    """
    _check_layout(scale_layout, x, fmt)
    axis = check_quantize_inputs(x, fmt, axis, key)
    x = jnp.asarray(x)
    shape = x.shape
    a = axis % x.ndim
    if a == x.ndim - 1:
        x3 = x.reshape(1, math.prod(shape[:-1]), shape[-1])
        row_fmt, col_fmt, orient = fmt, None, "row"
    else:
        x3 = x.reshape(math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:]))
        row_fmt, col_fmt, orient = None, fmt, "col"
    amax = _amax(x, x3, fmt, orient)
    kw = _key_words(fmt, key)
    o = quantize_3d(x3, amax, amax, kw, kw, row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=scale_layout)
    data, scale, w = (o[f"{orient}_data"], o[f"{orient}_scale"], o[f"{orient}_wamax"])
    data = data.reshape(fmt.data_shape(shape, axis))
    if scale_layout == "compact":
        scale = scale.reshape(fmt.scale_shape(shape, axis))
    w = _wamax(fmt, w, _window_shape(fmt, shape, axis), x, a)
    return QuantizedArray(data, scale, _scalar_amax(fmt, amax, _has_nan(x, fmt)), w, fmt=fmt, axis=axis,
                          scale_layout=scale_layout)


def quantize_rowwise_columnwise(x, row_fmt: Format | None, col_fmt: Format | None, *, key=None,
                                scale_layout: str = "compact", dbias: bool = False, exact=(False, False),
                                amax=None):
    """Rowwise and columnwise quantizations of x from one read (the GEMM operands of fprop and wgrad).

    x (rank >= 2) is viewed as the matrix x2 = x.reshape(M, K), M = prod(x.shape[:-1]).

    Args:
      x: bfloat16, float16 or float32 [..., K].
      row_fmt: format of the rowwise quantization (blocks along K), or None.
      col_fmt: format of the columnwise quantization (blocks along M), or None. Any pairing is allowed, e.g.
        NVFP4 rowwise with MXFP8 columnwise (the NVFP4-forward / MXFP8-backward recipe) in one kernel launch.
      key: PRNG key for stochastic rounding; the rowwise and columnwise streams use `jax.random.split(key)[0]`
        and `[1]`.
      scale_layout: "compact" or "swizzled" for both.
      dbias: also return float32[K], the column sums of x (the bias gradient when x is dY).
      exact: (rowwise, columnwise) bools: return that orientation as a `jax_fp4.gemm.ExactOperand` (bfloat16
        value(q) * block scale in x's / x2's shape, and the NVFP4 tensor scale) instead of a QuantizedArray: the
        emulated GEMM's operand written by the quantize pass itself, bit for bit `exact_operand` of the
        QuantizedArray it replaces, without a dequantize pass. NVFP4 1D/2D/RHT and MXFP8 only.
      amax: None, or x's tensor amax as the caller computed it: ``jnp.max(jnp.abs(x))`` (a float scalar, widened to
        float32; NaN when x holds a NaN), typically fused by XLA into the op that produced x. It replaces the
        tensor-amax pass of the NVFP4 orientations without RHT and the NaN pass (`tensor_amax` and the NaN flag
        both re-read x); RHT orientations still run their own amax pass. The results equal those without it bit for
        bit when x holds no NaN (the maximum is exact in any order; on a platform that flushes subnormals to zero,
        such as XLA:CPU, a tensor whose largest magnitude is subnormal reads amax 0 there). With a NaN in x the
        carried amax is NaN as without it, so every dequantized value and GEMM product is NaN alike, but the codes
        and block scales are encoded with amax 0 instead of the amax of the finite values.

    Returns:
      (row, col, dbias): row == quantize(x, row_fmt, axis=-1, key=k0) and col == quantize(x2, col_fmt, axis=0,
      key=k1) bit for bit (None where the format is None; ExactOperands where `exact` says); dbias float32[K] or
      None. dbias is an fp32 sum: its value depends on the summation order (the kernel sums 64-row stripes, then the
      stripes), not bit-exact.

    Raises:
      ValueError as `quantize` for each orientation; both formats None; rank < 2; `exact` for a missing or 1x64
      format; an `amax` that is not a float scalar.
    """
    fmt0 = row_fmt if row_fmt is not None else col_fmt
    if fmt0 is None:
        raise ValueError(f"quantize_rowwise_columnwise: both formats are None (x {jnp.shape(x)})")
    _check_layout(scale_layout, x, fmt0)
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"quantize_rowwise_columnwise: x must have rank >= 2, got {x.dtype}{list(x.shape)}")
    M, K = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(M, K)
    needs_key = any(f is not None and f.needs_key for f in (row_fmt, col_fmt))
    check_key(key, "quantize_rowwise_columnwise")  # a non-key is refused even where no format rounds stochastically
    keys = jax.random.split(key) if (needs_key and key is not None) else (None, None)
    if row_fmt is not None:
        check_quantize_inputs(x, row_fmt, -1, keys[0])
    if col_fmt is not None:
        check_quantize_inputs(x2, col_fmt, 0, keys[1])
    x3 = x2.reshape(1, M, K)
    given, given_nan = _given_amax(amax, x, "quantize_rowwise_columnwise")
    amax_r = _amax(x, x3, row_fmt, "row", given)
    amax_c = amax_r if (_same_amax(row_fmt, col_fmt)) else _amax(x, x3, col_fmt, "col", given)
    o = quantize_3d(x3, amax_r, amax_c, _key_words(row_fmt, keys[0]), _key_words(col_fmt, keys[1]),
                    row_fmt=row_fmt, col_fmt=col_fmt, scale_layout=scale_layout, dbias=dbias, exact=exact)
    row = col = None
    db = jnp.sum(o["dbias"], axis=(0, 1)) if dbias else None
    if given is None or x.size == 0:
        nan = _has_nan(x, row_fmt, col_fmt)
    else:  # the caller's amax is NaN exactly when x holds a NaN
        nan = given_nan if _has_nan_flag(row_fmt, col_fmt) else None
    if exact[0]:
        row = ExactOperand(o["row_data"].reshape(x.shape), _tensor_scale(row_fmt, amax_r, nan))
    elif row_fmt is not None:
        scale = o["row_scale"]
        if scale_layout == "compact":
            scale = scale.reshape(row_fmt.scale_shape(x.shape, -1))
        w = _wamax(row_fmt, o["row_wamax"], _window_shape(row_fmt, x.shape, -1), x, -1)
        row = QuantizedArray(o["row_data"].reshape(row_fmt.data_shape(x.shape, -1)), scale,
                             _scalar_amax(row_fmt, amax_r, nan), w, fmt=row_fmt, axis=-1, scale_layout=scale_layout)
    if exact[1]:
        v = o["col_data"][0]
        col = ExactOperand(v.T if col_fmt.stores_block_axis_last else v, _tensor_scale(col_fmt, amax_c, nan))
    elif col_fmt is not None:
        scale = o["col_scale"]
        if scale_layout == "compact":
            scale = scale.reshape(col_fmt.scale_shape((M, K), -2))
        w = _wamax(col_fmt, o["col_wamax"], _window_shape(col_fmt, (M, K), -2), x2, 0)
        col = QuantizedArray(o["col_data"].reshape(col_fmt.data_shape((M, K), -2)), scale,
                             _scalar_amax(col_fmt, amax_c, nan), w, fmt=col_fmt, axis=-2, scale_layout=scale_layout)
    return row, col, db


def _tensor_scale(fmt, amax, nan=None):
    """float32 amax * fp32(1/2688) of an NVFP4 orientation (scaled_dot_general's tensor scale, `tensor_decode_scale`),
    None for MXFP8."""
    a = _scalar_amax(fmt, amax, nan)
    return None if a is None else tensor_decode_scale(a, fmt.global_e4m3_max)


def _window_shape(fmt, shape, axis):
    return fmt.window_amax_shape(shape, axis) if fmt.local_1x64 else None


def _same_amax(row_fmt, col_fmt):
    """Both orientations encode with the plain tensor amax (no RHT, no 1x64): one amax pass serves both."""
    def plain(f):
        return f is not None and f.has_tensor_amax and not f.rht
    return plain(row_fmt) and plain(col_fmt)


def dequantize(q: QuantizedArray, dtype=jnp.float32):
    """Dequantize a QuantizedArray to `dtype` (float32, bfloat16 or float16) with the original x's shape.

    NVFP4: value(q) * ((s_b * amax) * fp32(1/2688)) (TE `dequantize_nvfp4.cuh`); 1x64: value(q) * s_b / S_enc,w;
    RHT tensors get the inverse transform. MXFP8: float(q) * 2**(e - 127); a code that rounded up past `dtype`'s
    range gives its largest finite value, not inf (docs/numerics.md section 2). Rounded once to `dtype` (RNE,
    canonical NaN). Swizzled scales are read directly (no separate unswizzle). Empty tensors give empty outputs.

    Runs the `jf4_dequantize` primitive: the CUDA kernel where built (one launch, no launch for an empty tensor),
    the bit-exact reference (`jax_fp4.reference.dequantize`) elsewhere; the bits are the same. jit, vmap and
    sharded inputs (see jax_fp4/_src/primitives/partitioning.py) are supported.

    Raises:
      ValueError: `q` is not a QuantizedArray, a field inconsistent with its format (`QuantizedArray.validate`), or
      `dtype` is not float32/bfloat16/float16.
    """
    if not isinstance(q, QuantizedArray):
        raise ValueError(f"dequantize expects a jax_fp4.QuantizedArray, got {type(q).__name__}")
    return dequantize_array(q.validate(), dtype)


def swizzle_scales(q: QuantizedArray) -> QuantizedArray:
    """Return `q` with GEMM-swizzled scales (padded [round_up(rows,128), round_up(cols,4)]); no-op if already.

    The compact scales are viewed as the 2-D scale matrix [rows, cols] (block axis last, the other axes flattened;
    MXFP8 columnwise scales transposed first, docs/numerics.md section 3) and bound to the `jf4_swizzle` primitive (CUDA
    kernel where built; padding written as zero bytes).
    """
    if q.scale_layout == "swizzled":
        return q
    s = _swizzle(layout.scale_matrix(q.scale, q.axis, q.fmt.stores_block_axis_last))
    return QuantizedArray(q.data, s, q.amax, q.window_amax, fmt=q.fmt, axis=q.axis, scale_layout="swizzled")


def unswizzle_scales(q: QuantizedArray) -> QuantizedArray:
    """Return `q` with compact scales; exact inverse of `swizzle_scales` (the `jf4_unswizzle` primitive)."""
    if q.scale_layout == "compact":
        return q
    return QuantizedArray(q.data, compact_scales(q), q.amax, q.window_amax, fmt=q.fmt, axis=q.axis)
