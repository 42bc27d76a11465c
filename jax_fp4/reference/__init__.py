"""Pure-jnp, bit-exact reference of the jax_fp4 numeric contract (docs/numerics.md).

It is public (users, tests and benchmarks import it) and it is the default lowering of every primitive, so CPU
results are the GPU bits. Everything here is jittable and vmappable.
"""

from jax_fp4.reference import codes, layout, mxfp8, nvfp4, rht, sr
from jax_fp4.reference import quantize as quantize_module
from jax_fp4.reference.amax import amax
from jax_fp4.reference.grouped import GroupedQuantized, Representation, grouped_dequantize, grouped_quantize
from jax_fp4.reference.layout import pad_scales, swizzle, unswizzle
from jax_fp4.reference.quantize import Quantized, dequantize, quantize, swizzle_scales, unswizzle_scales

__all__ = [
    "GroupedQuantized", "Quantized", "Representation", "amax", "codes", "dequantize", "grouped_dequantize",
    "grouped_quantize", "layout", "mxfp8", "nvfp4", "pad_scales", "quantize", "quantize_module", "rht", "sr",
    "swizzle", "swizzle_scales", "unswizzle", "unswizzle_scales",
]
