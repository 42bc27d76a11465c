"""Tensor amax: the fmax-reduction of |x| (docs/numerics.md section 1, "Tensor scale").

`fmax` is CUDA's `fmaxf`: a NaN operand is ignored, so NaNs never reach the amax. The reduction works on the
fp32 bit patterns (non-negative fp32 values order like their bits as unsigned integers), so it is exact and
independent of the platform's denormal mode (XLA:CPU flushes fp32 subnormals in arithmetic; bit operations are
untouched).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_fp4.reference import _f32

__all__ = ["amax", "abs_bits"]


def abs_bits(x: jnp.ndarray) -> jnp.ndarray:
    """uint32 bit pattern of |float32(x)| with NaNs replaced by +0 (they lose every fmax)."""
    b = _f32.bits(x) & jnp.uint32(0x7FFFFFFF)
    return jnp.where(b > jnp.uint32(0x7F800000), jnp.uint32(0), b)


def amax(x: jnp.ndarray, axis=None) -> jnp.ndarray:
    """fmax-reduction of |x| in fp32.

    Args:
      x: bfloat16, float16 or float32 array of any shape (empty allowed).
      axis: axes to reduce (None = all), as in `jnp.max`.

    Returns:
      float32 array: the amax (a scalar for axis=None). NaNs are ignored; an empty or all-NaN reduction gives 0;
      +-inf gives inf. Subnormal inputs are kept exactly.

    Raises:
      ValueError: if x is not a floating-point array.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"amax expects a float array (bfloat16/float16/float32), got {x.dtype}{list(x.shape)}")
    b = abs_bits(x)
    axes = tuple(range(b.ndim)) if axis is None else _axes(axis, b.ndim)
    # uint32 max has identity 0, so an empty reduction gives +0.0.
    return _f32.from_bits(lax.reduce_max(b, axes))


def _axes(axis, ndim):
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axis)
