"""`make_einsum`: a drop-in `jnp.einsum` whose GEMMs follow a jax_fp4 `Recipe` (for einsum-written models).

`jnp.einsum` contracts its operands pairwise with ``lax.dot_general`` and takes the function it calls as
``_dot_general``; ``jnp.einsum(subscripts, x, w, _dot_general=make_dot_general(recipe))`` therefore quantizes every
contraction exactly as `jax_fp4.dot_general` with the same dimension numbers would (bit for bit: the einsum only
transposes / reshapes around the call). `make_einsum` packages that with the key handling of the Flax drop-ins:

  * ``nnx.Einsum(..., einsum_op=make_einsum(recipe))`` (NNX's Einsum takes an einsum op);
  * in Linen, `jax_fp4.flax.linen.Einsum` (``flax.linen.Einsum`` with a ``recipe``; flax's own takes neither an
    einsum op nor a dot_general), or ``make_einsum(recipe)(subscripts, x, w)`` inside a module: keys come from its
    "quantize" rng collection (``apply(..., rngs={"quantize": key})``);
  * plain JAX: ``make_einsum(recipe)(subscripts, x, w, key=key)``.

Contractions over several axes flatten them into K in x's axis order (`jax_fp4.dot_general`), whatever order
`jnp.einsum` lists them in: every block lies within x's last contracted axis, whose size must be a multiple of the
recipe's K block (BlockingError otherwise). `make_dot_general`
given as an einsum op raises TypeError naming `make_einsum`.

`jnp.einsum` runs its contractions inside its own `jax.jit` trace, so the key of a call is drawn *before* it (from
``key=``, the key source, or the Linen collection) and every contraction of that call uses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp4._src import jax_compat
from jax_fp4._src.vjp_util import forward_mode_message, refuse_forward_mode
from jax_fp4.flax.dot_general import _linen_key, make_dot_general
from jax_fp4.flax.nnx_layers import draw_key
from jax_fp4.recipes import resolve
from jax_fp4.validation import check_key

__all__ = ["make_einsum", "StreamEinsum"]


def _einsum(recipe, strict, rng_collection, subscripts, operands, key, kwargs):
    dg = make_dot_general(recipe, key=key, strict=strict, rng_collection=rng_collection)
    try:
        return jnp.einsum(subscripts, *operands, _dot_general=dg, **kwargs)
    except TypeError as e:  # a forward-mode level outside jnp.einsum's own jit, which refuse_forward_mode cannot see
        if not jax_compat.is_custom_vjp_forward_mode_error(e):
            raise
        raise TypeError(forward_mode_message(f"make_einsum({recipe.name})")) from None


def make_einsum(recipe, key=None, *, strict: bool = False, rng_collection: str = "quantize"):
    """A function with `jnp.einsum`'s signature whose contractions follow `recipe` (custom VJP, `jax_fp4.dense`).

    Args:
      recipe: a `jax_fp4.recipes.Recipe` or its name (`recipes.by_name`); BF16 is plain `jnp.einsum`.
      key: the key source when a call has no ``key=``: None (inside a Linen module its `rng_collection` stream,
        else no key), an ``nnx.RngStream`` / ``nnx.Rngs`` the model owns (the result is then a `StreamEinsum`, an
        NNX module carrying the stream in the model's state: fresh keys under nnx.jit / nnx.grad / nnx.scan), a
        callable (called each time the call is traced: under jax.jit once per compilation, so the compiled step
        reuses its key), or a fixed PRNG key. Keys are needed as for `make_dot_general`: when the forward rounds
        stochastically, or a stochastic-rounding recipe is differentiated.
      strict, rng_collection: as `make_dot_general` (contractions it cannot quantize run `lax.dot_general` with a
        warning, or raise with ``strict=True``).

    Returns:
      ``einsum(subscripts, *operands, key=None, **kwargs)`` (kwargs: `jnp.einsum`'s, e.g. ``precision``,
      ``preferred_element_type``; ``_dot_general`` is ours). Operands of a quantized contraction must be blockable
      by the recipe (`jax_fp4.blocking`): the contracted axes flatten into K, the free axes into M and N.

    Raises:
      TypeError: a recipe that is neither a Recipe nor a known name, or a key source of another type.
    """
    recipe = resolve(recipe, "make_einsum")
    if isinstance(key, (nnx.RngStream, nnx.Rngs)):
        return StreamEinsum(recipe, key, strict=strict, rng_collection=rng_collection)
    if isinstance(key, jax.Array):
        check_key(key, "make_einsum")
    if key is not None and not callable(key) and not isinstance(key, jax.Array):
        raise TypeError(f"make_einsum: key must be None, a PRNG key, an nnx.RngStream / nnx.Rngs or a callable "
                        f"returning a key, got {type(key).__name__}")

    def einsum(subscripts, *operands, key=None, **kwargs):
        check_key(key, f"make_einsum({recipe.name})")
        if recipe.quantized:  # before the key source is asked: one error whatever the keys
            refuse_forward_mode(f"make_einsum({recipe.name})", operands)
        k = key
        if k is None and recipe.needs_key:
            k = key_source() if callable(key_source) else key_source
            if k is None:
                k = _linen_key(rng_collection)
        return _einsum(recipe, strict, rng_collection, subscripts, operands, k, kwargs)

    key_source = key
    einsum.recipe = recipe
    return einsum


class StreamEinsum(nnx.Module):
    """`make_einsum(recipe, key=stream)` for an ``nnx.RngStream`` / ``nnx.Rngs`` key source: an NNX module holding
    the stream (so ``nnx.Einsum(..., einsum_op=...)`` carries it in the model's state) that draws one key per call
    with `jax_fp4.flax.nnx_layers.draw_key` (none for forward-only calls whose fprop rounds deterministically).
    Call: as `make_einsum`'s function."""

    def __init__(self, recipe, source, *, strict: bool = False, rng_collection: str = "quantize"):
        self.recipe = resolve(recipe, "StreamEinsum")
        self.source = source
        self.strict = strict
        self.rng_collection = rng_collection

    def __call__(self, subscripts, *operands, key=None, **kwargs):
        check_key(key, f"make_einsum({self.recipe.name})")
        if key is None and self.recipe.quantized:
            key = draw_key(self.recipe, self.source, self.rng_collection, operands, "make_einsum")
        return _einsum(self.recipe, self.strict, self.rng_collection, subscripts, operands, key, kwargs)
