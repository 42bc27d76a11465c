"""`jf4_rht_amax`: the tensor amax of an NVFP4 RHT operand, taken after the transform (docs/numerics.md section 1).

Operand x: bfloat16/float16/float32[P, M, K]. `orientation` "row" transforms 16-chunks along K (rowwise), "col"
16-chunks along M (columnwise, the wgrad operand). Result: float32[P], the fmax of |RHT(x[p])| (bf16-rounded
transform output, as quantize sees it) per leading index p.

Lowerings: CUDA FFI target `jf4_rht_amax` (cpp/quantize/rht_amax_ffi.cu: one read, per-block reduction, one
atomicMax per block and p on the bit pattern; the output is zeroed with cudaMemsetAsync, command-buffer safe);
the CPU handler of the same name (cpp/cpu/) when the CPU extension is built; the reference
(`reference.rht.forward` + `reference.amax`) everywhere else. vmap folds the batch into P.
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
from jax_fp4.reference import rht
from jax_fp4.reference.amax import amax as _amax

__all__ = ["rht_amax", "rht_amax_p"]

ORIENTATIONS = ("row", "col")
rht_amax_p = Primitive("jf4_rht_amax")
def_impl(rht_amax_p)


def _abstract_eval(x, *, orientation, local=False):
    if orientation not in ORIENTATIONS:
        raise ValueError(f"rht_amax: orientation must be 'row' or 'col', got {orientation!r}")
    if x.ndim != 3 or jnp.dtype(x.dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"rht_amax: expected a bfloat16/float16/float32 [P, M, K] array, got {x.dtype}{list(x.shape)}")
    n = x.shape[2] if orientation == "row" else x.shape[1]
    if n % rht.CHUNK:
        raise ValueError(f"rht_amax: the transformed axis of {x.dtype}{list(x.shape)} ({orientation}) is not % 16")
    return jax.core.ShapedArray((x.shape[0],), jnp.float32)


rht_amax_p.def_abstract_eval(_abstract_eval)


def _reference(x, *, orientation):
    y = x if orientation == "row" else jnp.swapaxes(x, 1, 2)
    return _amax(rht.forward(y), axis=(1, 2))


def _ffi_lowering(ctx, x, *, orientation):
    return jax.ffi.ffi_lowering("jf4_rht_amax")(ctx, x, col=np.int32(orientation == "col"))


register_lowerings(rht_amax_p, partitioning.amax, mlir.lower_fun(_reference, multiple_results=False),
                   cuda=_ffi_lowering if _ffi.ensure_registered() else None,
                   cpu=_ffi_lowering if _ffi.has_cpu_target("jf4_rht_amax") else None)


def _batch_rule(args, dims, *, orientation, local=False):
    (x,), (bd,) = args, dims
    x = jnp.moveaxis(x, bd, 0)
    b, p = x.shape[:2]
    out = rht_amax_p.bind(x.reshape(b * p, *x.shape[2:]), orientation=orientation)
    return out.reshape(b, p), 0


batching.primitive_batchers[rht_amax_p] = _batch_rule
ad.defjvp(rht_amax_p, None)


def rht_amax(x3, orientation: str):
    """float32[P]: amax of the RHT (16-chunks along K for "row", along M for "col") of x3 [P, M, K] per p."""
    return rht_amax_p.bind(x3, orientation=orientation)
