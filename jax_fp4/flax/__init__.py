"""Flax layers whose GEMMs follow a jax_fp4 training `Recipe` (needs flax: ``pip install jax_fp4[flax]``).

  jax_fp4.flax.nnx     NNX modules   Dense, LayerNormDense, LayerNormMLP (GELU / SwiGLU)
  jax_fp4.flax.linen   Linen modules Dense, LayerNormDense, LayerNormMLP (GELU / SwiGLU)
  make_dot_general     a drop-in ``dot_general`` for existing Flax modules (nnx.Linear, nn.Dense, ...)

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

import jax.numpy as jnp
from jax import lax

from jax_fp4.dense import dot_general as _fp4_dot_general
from jax_fp4.recipes import Recipe

__all__ = ["linen", "nnx", "moe", "make_dot_general"]


def _supported(lhs, rhs, dimension_numbers) -> bool:
    """Whether jax_fp4.dot_general handles these operands: lhs[..., K] . rhs[K, ...], floating, no batch axes."""
    (cx, cw), (bx, bw) = dimension_numbers
    ndim = jnp.ndim(lhs)
    return (not bx and not bw and tuple(cx) in ((ndim - 1,), (-1,)) and tuple(cw) == (0,) and ndim >= 1
            and jnp.ndim(rhs) >= 2 and jnp.issubdtype(jnp.result_type(lhs), jnp.floating)
            and jnp.issubdtype(jnp.result_type(rhs), jnp.floating))


def make_dot_general(recipe: Recipe, key=None, *, strict: bool = False):
    """A function with `lax.dot_general`'s signature whose GEMM follows `recipe` (custom VJP, `jax_fp4.dot_general`).

    Use it to quantize existing Flax modules without rewriting them::

        layer = nnx.Linear(1024, 4096, dot_general=make_dot_general(recipes.MXFP8()), rngs=rngs)
        layer = nn.Dense(4096, dot_general=make_dot_general(recipes.NVFP4Fwd_MXFP8Bwd()))

    Args:
      recipe: a `jax_fp4.recipes.Recipe`. `recipes.BF16()` (nothing quantized) calls `lax.dot_general` unchanged.
      key: PRNG key for stochastic rounding. Required when ``recipe.needs_key`` (e.g. `recipes.NVFP4()`, which rounds
        the gradient dy stochastically); the *same* key is then used on every call, so the rounding noise repeats
        from step to step. The drop-in is therefore meant for deterministic recipes (MXFP8, NVFP4Fwd_MXFP8Bwd,
        NVFP4_1x64, ``NVFP4(stochastic_rounding=False)``); for stochastic rounding use the `jax_fp4.flax.nnx` /
        `jax_fp4.flax.linen` layers, which draw a fresh key from the Flax rng stream on every call.
      strict: with the default False, operands that `jax_fp4.dot_general` does not support (dimension numbers other
        than lhs[..., K] . rhs[K, ...] without batch axes, e.g. attention's batched einsums, or non-float dtypes)
        fall back to plain `lax.dot_general`; with True they raise ValueError instead.

    Returns:
      ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None)``.
      On the quantized path the result has lhs's dtype (float32 accumulation), or ``preferred_element_type`` when
      given; ``precision`` does not apply (the recipe fixes the operand formats) and ``out_sharding`` must be None.
      Shapes the recipe's formats cannot block (e.g. NVFP4 needs K % 16 == 0) raise ValueError; they never fall back
      silently.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"make_dot_general: recipe must be a jax_fp4.recipes.Recipe, got {type(recipe).__name__}")

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None,
                    **kwargs):
        if not recipe.quantized or not _supported(lhs, rhs, dimension_numbers):
            if recipe.quantized and strict:
                raise ValueError(f"make_dot_general({recipe.name}, strict=True): unsupported operands "
                                 f"{jnp.shape(lhs)} . {jnp.shape(rhs)} with dimension numbers {dimension_numbers}")
            if out_sharding is not None:
                kwargs["out_sharding"] = out_sharding
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
        if out_sharding is not None or kwargs:
            raise NotImplementedError(f"make_dot_general({recipe.name}): out_sharding / {sorted(kwargs)} are not "
                                      "supported on the quantized path")
        y = _fp4_dot_general(lhs, rhs, dimension_numbers, recipe=recipe, key=key)
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    dot_general.recipe = recipe
    return dot_general


from jax_fp4.flax import linen, moe, nnx  # noqa: E402  (after make_dot_general: the submodules may import it)
