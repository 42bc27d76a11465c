"""jax_fp4: NVFP4 and MXFP8 block-scaled quantization for JAX, bit-exact to the hardware's numerics.

Public surface (the README's "API" section has the signatures; the numeric contract is docs/numerics.md):
  NVFP4, MXFP8, Format                  format specs (frozen, hashable; jax_fp4.formats)
  quantize, quantize_rowwise_columnwise -> QuantizedArray (one orientation, or both from one read)
  dequantize                            QuantizedArray -> float32 / bfloat16 / float16
  fake_quantize                         dequantize(quantize(x)) with a straight-through gradient (QAT)
  swizzle_scales, unswizzle_scales      compact <-> GEMM-swizzled scale layout
  tensor_amax                           fmax-reduction of |x| (CUDA kernel where available)
  scaled_dot_general                    product of two QuantizedArrays on a route of jax_fp4.route.gemm_route: the
                                        jf4_gemm kernel (compute capability 9.x), native (>= 10) or emulated
  grouped_quantize, grouped_quantize_rowwise_columnwise, grouped_dequantize
                                        MoE groups in one call -> / <- GroupedQuantizedArray
  recipes, dense, dot_general           quantized training: custom-VJP GEMMs following a Recipe
  ragged_dot                            quantized jax.lax.ragged_dot (MoE expert GEMMs), custom VJP
  reference                             the pure-jnp bit-exact reference of every op
  HAS_CUDA_KERNELS, ReferenceOnlyWarning  whether the CUDA extension loaded; the import warning of a missing or
                                        unloadable extension (only where it can be fixed: jax_fp4._src.ffi)
  env_report, __version__               the environment report of `python -m jax_fp4`; the package version
Flax layers: jax_fp4.flax (needs flax).
"""

from jax_fp4 import recipes, reference
from jax_fp4._src import ffi as _ffi
from jax_fp4._src.ffi import HAS_CUDA_KERNELS, ReferenceOnlyWarning
from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4._version import __version__ as __version__
from jax_fp4.dense import dense, dot_general
from jax_fp4.env import env_report
from jax_fp4.fake_quantize import fake_quantize
from jax_fp4.formats import MXFP8, NVFP4, Format
from jax_fp4.gemm import scaled_dot_general
from jax_fp4.grouped import grouped_dequantize, grouped_quantize, grouped_quantize_rowwise_columnwise
from jax_fp4.grouped_array import GroupedQuantizedArray
from jax_fp4.grouped_gemm import ragged_dot
from jax_fp4.quantize import dequantize, quantize, quantize_rowwise_columnwise, swizzle_scales, unswizzle_scales
from jax_fp4.quantized_array import QuantizedArray

__all__ = [
    "HAS_CUDA_KERNELS", "MXFP8", "NVFP4", "Format", "QuantizedArray", "ReferenceOnlyWarning", "dense", "dequantize",
    "dot_general", "env_report", "fake_quantize", "recipes", "scaled_dot_general",
    "GroupedQuantizedArray", "grouped_dequantize", "grouped_quantize", "grouped_quantize_rowwise_columnwise",
    "ragged_dot",
    "quantize", "quantize_rowwise_columnwise", "reference", "swizzle_scales", "tensor_amax", "unswizzle_scales",
]
del _ffi
