"""`make_dot_general`: a drop-in `lax.dot_general` whose GEMMs follow a jax_fp4 `Recipe` (for existing Flax modules).

Any dimension numbers run through `jax_fp4.dot_general` (which maps them onto `jax_fp4.dense`): lhs is transposed to
(batch, free, contracting) and rhs to (batch, contracting, free) (no transpose when the axes are already there, as for
nn.Dense and DenseGeneral's ``(((2, 3), (0, 1)), ((), ()))``), the contracting axes are flattened into one K axis
(the block axis) and the free axes into M and N, batch axes into one axis B that `jax.vmap` maps `dense` over (one
tensor scale per batch element), and the result has `lax.dot_general`'s layout (batch, lhs free, rhs free).

What is not quantized (plain `lax.dot_general`): BF16 recipes; non-floating operands; an rhs without free axes (a
matrix-vector product: N would be empty). Each such form is reported once per (shapes' ranks, dimension numbers,
reason) with `warnings.warn` (`UnquantizedDotGeneralWarning`), or raises ValueError with ``strict=True``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_fp4._src import jax_compat
from jax_fp4._src.dimension_numbers import canonical_dimension_numbers
from jax_fp4._src.vjp_util import refuse_forward_mode
from jax_fp4.blocking import BlockingError
from jax_fp4.dense import dot_general as _fp4_dot_general
from jax_fp4.flax.layer_path import calling_layer_path
from jax_fp4.flax.nnx_layers import draw_key
from jax_fp4.recipes import resolve
from jax_fp4.validation import check_key

__all__ = ["make_dot_general", "StreamDotGeneral", "UnquantizedDotGeneralWarning"]


class UnquantizedDotGeneralWarning(UserWarning):
    """A `make_dot_general` call that runs unquantized (`lax.dot_general`), reported once per form."""


_REPORTED: set = set()


def _unquantized_reason(lhs, rhs, dn):
    (cl, cr), (bl, br) = dn
    if not (jnp.issubdtype(jnp.result_type(lhs), jnp.floating) and jnp.issubdtype(jnp.result_type(rhs), jnp.floating)):
        return "non-floating operands"
    if not cl:
        return "no contracting dimension (an outer product)"
    if jnp.ndim(rhs) == len(cr) + len(br):
        return "rhs has no free dimension (a matrix-vector product)"
    return None


def _linen_key(rng_collection):
    """A fresh key from the innermost bound Linen module's `rng_collection` stream, or None (no Linen module, or
    no such stream)."""
    from flax.errors import InvalidRngError

    module = jax_compat.current_linen_module()
    if module is None or getattr(module, "scope", None) is None:
        return None
    try:
        return module.make_rng(rng_collection)
    except InvalidRngError:
        return None


def make_dot_general(recipe, key=None, *, strict: bool = False, rng_collection: str = "quantize"):
    """A function with `lax.dot_general`'s signature whose GEMM follows `recipe` (custom VJP, `jax_fp4.dense`).

    Use it to quantize existing Flax modules without rewriting them::

        layer = nnx.Linear(1024, 4096, dot_general=make_dot_general(recipes.MXFP8()), rngs=rngs)
        layer = nn.Dense(4096, dot_general=make_dot_general(recipes.NVFP4Fwd_MXFP8Bwd()))
        attn_out = nn.DenseGeneral(d, axis=(-2, -1), dot_general=make_dot_general("mxfp8"))

    Args:
      recipe: a `jax_fp4.recipes.Recipe` or its name (`recipes.by_name`). `recipes.BF16()` (nothing quantized) calls
        `lax.dot_general` unchanged.
      key: where the stochastic-rounding keys come from when a call has no ``key=`` argument:
        None (default): inside a Linen module, a fresh ``module.make_rng(rng_collection)`` per call when that
        stream exists, e.g. ``apply(..., rngs={"quantize": k})``; else no key.
        An ``nnx.RngStream`` (or ``nnx.Rngs``: its `rng_collection` stream) that the model owns: the result is then
        a `StreamDotGeneral`, an ``nnx.Module`` holding the stream, so a layer built with it
        (``nnx.Linear(..., dot_general=make_dot_general(r, key=self.q))``) carries the stream in its state and
        every call under nnx.jit / nnx.grad / nnx.scan draws a fresh key (the stream advances as state).
        Forward-only calls whose fprop rounds deterministically leave it alone (`nnx_layers.draw_key`).
        Another callable: called for a key each time the call is *traced*, so under jax.jit once per compilation:
        every execution of the compiled step reuses the key it returned then (the same rounding noise every step),
        unless the callable reads traced state itself; prefer a model-owned RngStream or ``key=`` per call.
        A fixed PRNG key: the same rounding noise on every call.
        A key is needed only when the forward rounds stochastically or when a call of a stochastic-rounding recipe
        (e.g. `recipes.NVFP4()`) is differentiated; forward-only calls need none.
      strict: False (default): forms that are not quantized (module docstring) run `lax.dot_general` after one
        `UnquantizedDotGeneralWarning` per form; True: they raise ValueError.
      rng_collection: the Linen rng stream of the keys (default "quantize").

    Returns:
      ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None, *,
      key=None)``. On the quantized path the result has the promoted operand dtype (float32 accumulation), or
      ``preferred_element_type`` when given; ``precision`` does not apply (the recipe fixes the operand formats)
      and ``out_sharding`` must be None. ``key`` overrides the key source for this call. Shapes the recipe's
      formats cannot block (e.g. NVFP4 needs K % 16 == 0) raise ValueError; they never fall back silently.

    Raises:
      TypeError: a recipe that is neither a Recipe nor a known name. ValueError: a dimension outside an operand's
      rank, unpaired dimension numbers.
    """
    recipe = resolve(recipe, "make_dot_general")
    if isinstance(key, (nnx.RngStream, nnx.Rngs)):
        return StreamDotGeneral(make_dot_general(recipe, strict=strict, rng_collection=rng_collection), key,
                                rng_collection)
    if isinstance(key, jax.Array):
        check_key(key, "make_dot_general")
    if key is not None and not callable(key) and not isinstance(key, jax.Array):
        raise TypeError(f"make_dot_general: key must be None, a PRNG key or a callable returning one, got "
                        f"{type(key).__name__}")

    def call_key(explicit):
        if explicit is not None:
            return explicit
        if not recipe.needs_key:
            return None
        if isinstance(key, jax.Array):
            return key
        if callable(key):
            return key()
        return _linen_key(rng_collection)

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None,
                    *, key=None, **kwargs):
        if isinstance(lhs, str):  # called as an einsum op: nnx.Einsum(einsum_op=make_dot_general(...))
            raise TypeError(f"make_dot_general({recipe.name}) was called as an einsum op (subscripts {lhs!r}): "
                            "it is a lax.dot_general drop-in. For nnx.Einsum use "
                            f"einsum_op=jax_fp4.flax.einsum.make_einsum({recipe.name!r}); in Linen, "
                            "jax_fp4.flax.linen.Einsum")
        check_key(key, f"make_dot_general({recipe.name})")  # (a non-key is refused on every path)
        if recipe.quantized:  # before the key source is asked: one error whatever the keys
            refuse_forward_mode(f"make_dot_general({recipe.name})", lhs, rhs)
        dn = canonical_dimension_numbers(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
        reason = None if recipe.quantized else "bf16"
        if reason is None:
            reason = _unquantized_reason(lhs, rhs, dn)
            if reason is not None:
                if strict:
                    raise ValueError(f"make_dot_general({recipe.name}, strict=True): unsupported operands "
                                     f"{jnp.shape(lhs)} . {jnp.shape(rhs)} with dimension numbers "
                                     f"{dimension_numbers}: {reason}")
                form = (recipe.name, jnp.ndim(lhs), jnp.ndim(rhs), dn, reason)
                if form not in _REPORTED:
                    _REPORTED.add(form)
                    warnings.warn(f"jax_fp4 make_dot_general({recipe.name}): dimension numbers {dimension_numbers} "
                                  f"for ranks {jnp.ndim(lhs)} . {jnp.ndim(rhs)} run unquantized "
                                  f"(lax.dot_general): {reason}", UnquantizedDotGeneralWarning, stacklevel=2)
        if reason is not None:
            if out_sharding is not None:
                kwargs["out_sharding"] = out_sharding
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
        if out_sharding is not None or kwargs:
            raise NotImplementedError(f"make_dot_general({recipe.name}): out_sharding / {sorted(kwargs)} are not "
                                      "supported on the quantized path")
        try:
            y = _fp4_dot_general(lhs, rhs, dn, recipe=recipe, key=call_key(key))
        except BlockingError as e:  # name the calling layer's module path
            raise e.with_layer(calling_layer_path()) from None
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    dot_general.recipe = recipe
    return dot_general


class StreamDotGeneral(nnx.Module):
    """`make_dot_general(recipe, key=stream)` for an ``nnx.RngStream`` / ``nnx.Rngs`` key source: an NNX module
    holding the stream (so the layer that holds this dot_general carries the stream in its state, through nnx.jit,
    nnx.grad and nnx.scan) and calling `make_dot_general(recipe)` with a key drawn per call by
    `jax_fp4.flax.nnx_layers.draw_key` (none for forward-only calls whose fprop rounds deterministically).
    Attributes: ``recipe``, ``source`` (the stream), ``rng_collection``. Call: as `make_dot_general`'s function."""

    def __init__(self, fn, source, rng_collection: str):
        self.fn = fn
        self.recipe = fn.recipe
        self.source = source
        self.rng_collection = rng_collection

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None,
                 *, key=None, **kwargs):
        if key is None and self.recipe.quantized:
            key = draw_key(self.recipe, self.source, self.rng_collection, (lhs, rhs), "make_dot_general")
        return self.fn(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, key=key, **kwargs)
