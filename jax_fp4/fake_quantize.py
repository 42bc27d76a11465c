"""`fake_quantize`: dequantize(quantize(x)) with a straight-through (STE) gradient, for quantization-aware training.

`quantize` itself has no derivative (its outputs are codes and block scales, piecewise constant in x): differentiating
it raises TypeError pointing here. `fake_quantize` is the differentiable round trip: the forward value is bit for
bit ``dequantize(quantize(x, fmt, axis=axis, key=key), x.dtype)`` and the gradient is the straight-through
estimator (Bengio et al. 2013, "Estimating or Propagating Gradients Through Stochastic Neurons"): the cotangent
passes unchanged, or, with ``clip_gradient=True``, is zero where the quantizer clipped x, the derivative of a clip
(as `jnp.clip` and `jax.nn.hard_tanh` differentiate: zero outside the range).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4.formats import Format
from jax_fp4.quantize import dequantize, quantize
from jax_fp4.validation import check_key

__all__ = ["fake_quantize"]


def _clipped(x, q, y):
    """bool of x's shape: the element was clipped (its code is the format's largest magnitude and |x| > |y|)."""
    codes = jnp.abs(q.data.astype(jnp.float32))
    if q.fmt.stores_block_axis_last:
        codes = jnp.moveaxis(codes, -1, q.axis)
    return (codes == q.fmt.max_value) & (jnp.abs(x.astype(jnp.float32)) > jnp.abs(y.astype(jnp.float32)))


@partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _fake_quantize(fmt, axis, clip_gradient, x, key):
    return dequantize(quantize(x, fmt, axis=axis, key=key), x.dtype)


@_fake_quantize.defjvp
def _fake_quantize_jvp(fmt, axis, clip_gradient, primals, tangents):
    """The straight-through rule in forward mode: the tangent passes (zero where clipped). It is linear in the
    tangent, so JAX transposes it for reverse mode, and the primal is `_fake_quantize` itself, so higher orders (a
    Hessian) differentiate the same rule again (the STE's second derivative is 0)."""
    x, key = primals
    t, _ = tangents
    y = _fake_quantize(fmt, axis, clip_gradient, x, key)
    if clip_gradient:
        xs = lax.stop_gradient(x)  # the mask is piecewise constant in x
        q = quantize(xs, fmt, axis=axis, key=key)
        t = jnp.where(_clipped(xs, q, dequantize(q, x.dtype)), jnp.zeros_like(t), t)
    return y, t


def fake_quantize(x, fmt: Format, axis: int = -1, *, key=None, clip_gradient: bool = False):
    """Quantize-dequantize `x` through `fmt` with a straight-through gradient.

    Args:
      x: bfloat16, float16 or float32 array of rank >= 1 (the constraints of `jax_fp4.quantize`: the block axis a
        multiple of the block size, 16 NVFP4 / 32 MXFP8).
      fmt: `jax_fp4.NVFP4(...)` or `jax_fp4.MXFP8(...)`.
      axis: the block axis (int), as `jax_fp4.quantize`.
      key: PRNG key, required by NVFP4(stochastic_rounding=True) (the forward is then stochastic).
      clip_gradient: False (default): the gradient is the cotangent itself (pure STE). True: zero where the
        element was clipped, i.e. its code is the format's largest magnitude (6 for E2M1, 448 for E4M3, 57344
        for E5M2) and |x| exceeds the dequantized value: there the forward is a clip, whose derivative is 0.
        NVFP4 with RHT has no elementwise clip (the transform mixes 16 elements) and raises ValueError.

    Returns:
      x.dtype, x.shape: ``dequantize(quantize(x, fmt, axis=axis, key=key), x.dtype)``, bit for bit.

    Derivatives: a custom JVP (the straight-through rule in forward mode, linear in the tangent), so every JAX
    transformation works: jax.grad, jax.vjp, jax.jacrev (reverse mode, by transposing it), jax.jvp, jax.jacfwd,
    jax.linearize, and jax.hessian (second derivative 0: the STE is linear). NaN / Inf tangents and cotangents pass
    unchanged (zero where clipped with clip_gradient=True).

    Raises:
      ValueError / TypeError as `jax_fp4.quantize` (bad dtype, shape, axis or a missing key); ValueError for
      clip_gradient with an RHT format; TypeError when `fmt` is not a Format, clip_gradient not a bool, or `key`
      neither None nor a JAX PRNG key.
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"fake_quantize: fmt must be a jax_fp4 Format (jax_fp4.NVFP4(), jax_fp4.MXFP8()), got "
                        f"{type(fmt).__name__} {fmt!r}")
    if not isinstance(clip_gradient, bool):
        raise TypeError(f"fake_quantize: clip_gradient must be a bool, got {clip_gradient!r}")
    if clip_gradient and fmt.rht:
        raise ValueError(f"fake_quantize: clip_gradient needs an elementwise quantizer; {fmt!r} applies the RHT, "
                         "which mixes each 16-element chunk")
    check_key(key, "fake_quantize")
    x = jnp.asarray(x)
    axis = fmt.normalize_axis(x.shape, axis)  # clear errors (axis=None, out of range) before the custom JVP
    return _fake_quantize(fmt, axis, clip_gradient, x, key)
