"""`exact_gemm`: `jax_fp4.dense`'s emulated GEMMs over exact operands, in the form each device runs best.

The bits of every form are those of docs/numerics.md, "GEMM emulation"; the summation order is the device's.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_fp4._src.emulation.product import exact_product
from jax_fp4._src.emulation.sharded import narrow_product, reduced_product

__all__ = ["FPROP", "exact_gemm"]

#: dense's fprop dimension numbers: x[M, K] . w[K, N].
FPROP = (((1,), (0,)), ((), ()))


def exact_gemm(va, ta, vb, tb, dn, out_dtype, bias=None, reduce_out=False):
    """A GEMM over exact operands (values va / vb, tensor scales ta / tb or None): `exact_product` (+ bias in
    float32), cast to out_dtype once; reduce_out: `reduced_product` instead (a sharded contraction summed in
    out_dtype, `jax_fp4.distributed`).

    On CUDA devices (`lax.platform_dependent`) the program is written so that XLA runs its dot on cuBLAS; the
    arithmetic is the same (float32 accumulation of exact products, the tensor scales multiplied in after, lhs's
    first, one rounding to out_dtype), the summation order is cuBLAS's:
      * no tensor scale and no bias (MXFP8 operands: the backward GEMMs of nvfp4-fwd-mxfp8-bwd, all of mxfp8): a
        `dot_general` that writes out_dtype directly; cuBLAS rounds its float32 accumulator once. Written as a
        float32 dot and a convert, XLA makes it a Triton GEMM fusion with the convert as its epilogue. The dot is
        `narrow_product`'s: where a mesh shards the contraction, the shards' float32 partial products are summed
        before the one rounding (XLA would partition the bfloat16-output dot into bfloat16 partial sums);
      * fprop with a tensor scale (NVFP4 x and w), no bias and no reduce_out: the float32 dot is kept apart from the
        scale multiplies and the cast by an optimization barrier, so it runs on cuBLAS and that epilogue fuses into the
        layer output's consumer; otherwise XLA fuses the tensor-scale arithmetic into a slower Triton GEMM. A
        bias add would land in whichever fusion XLA picks, where it may contract with the scale multiply into an
        FMA (a LayerNormMLP with biases then gave other bits with and without `x_amax`), so with a bias
        the GEMM stays as `exact_product` writes it. The rounding to out_dtype is a `reduce_precision` before the
        cast: XLA (allow_excess_precision, on by default) removes a
        float32 -> bfloat16 -> float32 convert pair inside a consumer fusion, which would hand some consumers the
        unrounded value and make the layer's bits depend on how XLA fuses its neighbours;
      * dgrad / wgrad with tensor scales (nvfp4): unchanged. Their outputs (dx, dw) leave the layer, so the
        separate epilogue pass would cost more than the Triton epilogue saves.
    The timings: docs/performance.md, "GEMM lowering". Elsewhere (the CPU) the program is `exact_product`
    as written, whose bits the CPU tests pin: XLA:CPU sums a bfloat16-output dot in another order.
    """

    def finish(y):
        return (y if bias is None else y + bias.astype(jnp.float32)).astype(out_dtype)

    def portable(va, vb, ta, tb):
        if reduce_out:
            return finish(reduced_product(va, vb, ta, tb, dn, out_dtype))
        return finish(exact_product([(va, ta), (vb, tb)], dn))

    narrow_out = jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    bf16 = va.dtype == vb.dtype == jnp.bfloat16
    if ta is None and tb is None and bias is None and narrow_out and bf16:
        def cublas(va, vb, ta, tb):  # (a sharded contraction sums in float32, or out_dtype: `narrow_product`)
            return narrow_product(va, vb, dn, out_dtype, out_dtype if reduce_out else jnp.float32)
    elif dn == FPROP and (ta is not None or tb is not None) and bias is None and bf16 and not reduce_out:
        def cublas(va, vb, ta, tb):
            y = lax.optimization_barrier(lax.dot_general(va, vb, dn, preferred_element_type=jnp.float32))
            for t in (ta, tb):
                y = y if t is None else y * t
            if narrow_out:  # rounded here: XLA may drop a float32 -> out_dtype -> float32 convert pair in consumers
                finfo = jnp.finfo(out_dtype)
                y = lax.reduce_precision(y, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
            return y.astype(out_dtype)
    else:
        return portable(va, vb, ta, tb)
    return lax.platform_dependent(va, vb, ta, tb, cuda=cublas, default=portable)


