"""Flax layers whose GEMMs follow a jax_fp4 training `Recipe` (needs flax: ``pip install jax_fp4[flax]``).

  jax_fp4.flax.nnx     NNX modules   Dense, LayerNormDense, LayerNormMLP (GELU / SwiGLU)
  jax_fp4.flax.linen   Linen modules Dense, LayerNormDense, LayerNormMLP (GELU / SwiGLU)
  make_dot_general     a drop-in ``dot_general`` for existing Flax modules (nnx.Linear, nn.Dense, ...)
  einsum.make_einsum   a drop-in ``jnp.einsum`` (nnx.Einsum's einsum_op; einsum-written models)

Every layer takes a `jax_fp4.recipes.Recipe` (BF16, MXFP8, NVFP4, NVFP4Fwd_MXFP8Bwd, NVFP4_1x64, ...) naming the
format of each GEMM operand in fprop, dgrad and wgrad; only the GEMMs are quantized (norms, activations and bias
additions stay in the compute dtype). Parameters are named and initialized as in Flax (``kernel`` [in, out],
lecun-normal; ``bias`` [out], zeros; LayerNorm ``scale`` / ``bias``). Recipes with stochastic rounding
(``recipe.needs_key``, e.g. NVFP4's gradient dy) draw a fresh PRNG key per call from the Flax rng stream
``"quantize"`` (NNX: an ``nnx.RngStream`` kept by the layer, seeded from ``rngs["quantize"]``, which falls back to
``rngs.default``; Linen: ``self.make_rng("quantize")``, pass ``rngs={"quantize": key}`` to ``apply``).

Importing ``jax_fp4`` never imports flax; importing ``jax_fp4.flax`` does.
"""

from __future__ import annotations

try:
    import flax as _flax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_flax.py
    raise ImportError("jax_fp4.flax needs flax, which is not installed: pip install jax_fp4[flax]") from e

from jax_fp4.flax.dot_general import UnquantizedDotGeneralWarning, make_dot_general

__all__ = ["linen", "nnx", "moe", "make_dot_general", "UnquantizedDotGeneralWarning"]

from jax_fp4.flax import linen, moe, nnx  # noqa: E402
