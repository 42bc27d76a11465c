"""`jf4_amax`: the tensor amax primitive, fmax-reduction of |x| over a whole tensor into one float32.

Lowerings:
  * CUDA (when the extension is built): FFI target `jf4_amax` (cpp/amax/amax_ffi.cu), one streaming pass, no
    host sync, command-buffer compatible.
  * CPU (when the CPU extension is built): the host handler `jf4_amax` (cpp/cpu/quantize_cpu.cc).
  * every other platform (and CUDA / CPU without the extension): `jax_fp4.reference.amax.amax` via `mlir.lower_fun`.
Both are bit-exact with each other: NaNs are ignored, +-inf gives inf, subnormals are kept, empty/all-NaN gives 0.

Transformations:
  * vmap: per-example amax (batch dimension kept, every other axis reduced), computed by the reference.
  * autodiff: the amax is a non-differentiable statistic (it sets quantization scales). Its JVP is a symbolic zero,
    i.e. `stop_gradient` semantics: `jax.grad` through `tensor_amax` succeeds and no gradient flows through it.
  * sharding: each shard reduces its part, then `lax.pmax` over the mesh axes sharding x (`partitioning.py`); the
    result is replicated and equals the unsharded amax bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src.primitives import partitioning
from jax_fp4._src.primitives._common import def_impl
from jax_fp4._src.primitives.partitioning_base import register_lowerings
from jax_fp4.reference.amax import amax as _reference_amax

__all__ = ["SUPPORTED_DTYPES", "amax_p", "tensor_amax"]

#: Input dtypes the primitive accepts.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

FFI_TARGET = "jf4_amax"

amax_p = Primitive("jf4_amax")
amax_p.multiple_results = False


def_impl(amax_p)


def _check_dtype(dtype, shape) -> None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(
            f"tensor_amax: expected a bfloat16, float16 or float32 array, got {jnp.dtype(dtype).name}"
            f"[{', '.join(map(str, shape))}]"
        )


def _abstract_eval(x, *, local=False):
    """x: bfloat16|float16|float32[...] (any rank, empty allowed) -> float32[] (a scalar)."""
    _check_dtype(x.dtype, x.shape)
    return jax.core.ShapedArray((), jnp.float32)


amax_p.def_abstract_eval(_abstract_eval)


def _reference(x):
    return _reference_amax(x)


# Default lowering: the exact pure-JAX reference (CPU, TPU, and CUDA without the extension).
register_lowerings(amax_p, partitioning.amax, mlir.lower_fun(_reference, multiple_results=False),
                   cuda=jax.ffi.ffi_lowering(FFI_TARGET) if _ffi.ensure_registered() else None,
                   cpu=jax.ffi.ffi_lowering(FFI_TARGET) if _ffi.has_cpu_target(FFI_TARGET) else None)


def _batch_rule(batched_args, batch_dims, **params):
    """vmap: per-example amax. Move the batch dim first and reduce every other axis with the reference."""
    (x,), (bd,) = batched_args, batch_dims
    if bd is None:  # not mapped (cannot happen for a one-operand primitive, kept for safety)
        return amax_p.bind(x), None
    _check_dtype(x.dtype, tuple(np.delete(np.asarray(x.shape), bd)))
    x = jnp.moveaxis(x, bd, 0)
    return _reference_amax(x, axis=tuple(range(1, x.ndim))), 0


batching.primitive_batchers[amax_p] = _batch_rule

# stop_gradient semantics: the tangent of the amax is a symbolic zero (no JVP / transpose rule needed).
ad.defjvp(amax_p, None)


def tensor_amax(x) -> jax.Array:
    """Tensor amax: the fmax-reduction of |x| over all elements, in float32.

    Args:
      x: bfloat16, float16 or float32 array of any shape (rank 0 and empty allowed).

    Returns:
      float32[] scalar. NaNs are ignored (CUDA `fmaxf`), +-inf gives inf, subnormal inputs are kept exactly, an
      empty or all-NaN input gives 0. Bit-identical on every platform (CUDA kernel or pure-JAX reference).

    Constraints (checked at trace time, `ValueError` otherwise):
      x.dtype in {bfloat16, float16, float32}.

    Non-differentiable statistic: under `jax.grad` it behaves like `jax.lax.stop_gradient` (zero tangent).
    """
    x = jnp.asarray(x)
    return amax_p.bind(x)
