"""The emulated block-scaled GEMM, in one place: how a product of exact operands is written for XLA.

An emulated GEMM multiplies exact operands (value(q) * block scale, exact in bfloat16: `jax_fp4.gemm.ExactOperand`,
`jax_fp4._src.primitives.gemm.exact_operand`) with float32 accumulation and then the NVFP4 tensor scales
(docs/numerics.md, "GEMM emulation"). Its forms, each with the reason it is written so:

  product.py     `exact_product`: the float32 product (a `dot_general` at HIGHEST precision, tensor scales after,
                 lhs's first); `cpu_float32_operands`: why the CPU's dots take float32 operands.
  layer_gemm.py  `exact_gemm`: `jax_fp4.dense`'s GEMMs (+ bias, one cast), in the form that puts the dot on cuBLAS on
                 CUDA devices and `exact_product` elsewhere, with the XLA-fusion guards each form needs.
  sharded.py     `reduced_product`, `narrow_product`: the sums of a contraction that a mesh shards, in a chosen dtype
                 (`custom_partitioning` functions that read the operand shardings); `layer_gemm` calls them.
Callers choose a form (`jax_fp4.dense`, `jax_fp4.gemm.exact_dot_general`, the
`jf4_gemm` primitive's emulated lowering); none builds its own.
"""
