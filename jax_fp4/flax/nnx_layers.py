"""Helpers of the Flax NNX layers (`jax_fp4.flax.nnx`, `jax_fp4.flax.moe`): recipe checks, the stochastic-rounding
rng stream of a layer and the norm sub-layer."""

from __future__ import annotations

import zlib

import jax
from flax import nnx
from flax.errors import TraceContextError

from jax_fp4._src import jax_compat
from jax_fp4._src.vjp_util import refuse_forward_mode
from jax_fp4.recipes import Recipe, resolve
from jax_fp4.validation import check_key

__all__ = ["NORMS", "RngsLike", "check_recipe", "check_rngs", "differentiated", "draw_key", "make_norm", "quantize_key",
           "quantize_stream", "split_rngs"]

NORMS = ("layernorm", "rmsnorm")

RngsLike = nnx.Rngs | nnx.RngStream | jax.Array | None


def check_recipe(recipe, where):
    """The Recipe of `recipe` (a Recipe or its name, `recipes.by_name`); TypeError naming `where` otherwise."""
    return resolve(recipe, where)


def split_rngs(rngs: RngsLike, n: int) -> list[RngsLike]:
    """n call-time rngs for n sub-layers: Rngs / RngStream / None are shared (each draw is fresh), a key is split."""
    if isinstance(rngs, jax.Array):
        return list(jax.random.split(rngs, n))
    return [rngs] * n


# Folded into the params stream's current key when a model's Rngs has no stream of the layer's rng_collection.
_DERIVED_STREAM_TAG = zlib.crc32(b"jax_fp4 stochastic rounding")


def quantize_stream(recipe: Recipe, rngs: nnx.Rngs, rng_collection: str, where: str):
    """A layer's own stochastic-rounding stream: when ``recipe.needs_key``, an ``nnx.RngStream`` tagged
    `rng_collection`, else ``nnx.data(None)``.

    Seed: one draw from ``rngs[rng_collection]`` when the `Rngs` has that stream (a dedicated "quantize" stream);
    otherwise derived from the params stream's current state *without drawing from it*: fold_in(fold_in(key,
    count), tag) of ``rngs["params"]`` (``rngs.default`` when there is no params stream). The params stream has
    just initialized the layer's weights, so every layer gets its own seed, and no stream of the model (default,
    params, dropout) advances: switching a model between a deterministic recipe and a stochastic-rounding one
    leaves its initial weights and dropout masks unchanged. ValueError naming `where` when there is neither.
    """
    if not recipe.needs_key:
        return nnx.data(None)
    if rng_collection in rngs:
        return nnx.RngStream(rngs[rng_collection](), tag=rng_collection)
    try:
        parent = rngs["params"]
    except KeyError:
        raise ValueError(f"{where}: recipe {recipe.name!r} uses stochastic rounding and needs an rng stream "
                         f"{rng_collection!r} (or 'params' / 'default'), e.g. nnx.Rngs(0) or "
                         f"nnx.Rngs(params=0, {rng_collection}=1)") from None
    seed = jax.random.fold_in(jax.random.fold_in(parent.key[...], parent.count[...]), _DERIVED_STREAM_TAG)
    return nnx.RngStream(seed, tag=rng_collection)


def differentiated(*operands) -> bool | None:
    """Whether a call on `operands` (arrays / pytrees) is being differentiated: True when one of them carries a
    reverse- or forward-mode tracer (jax.grad, nnx.grad, jax.vjp, jax.jvp), False when none is traced at all (an
    eager call), None when that cannot be told (traced by jax.jit / nnx.jit only, which may sit inside a grad)."""
    mode = jax_compat.autodiff_mode(operands)
    return None if mode == "unknown" else mode is not None


def check_rngs(rngs, where: str) -> None:
    """TypeError naming `where` unless `rngs` is None, an ``nnx.Rngs``, an ``nnx.RngStream`` or a JAX PRNG key.
    Checked on every call, whether or not the recipe rounds stochastically, so a wrong argument is never silently
    ignored."""
    if rngs is None or isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
        return
    if not isinstance(rngs, jax.Array):
        raise TypeError(f"{where}: rngs must be None, an nnx.Rngs, an nnx.RngStream or a JAX PRNG key "
                        f"(jax.random.key(seed)), got {type(rngs).__name__} {rngs!r}")
    check_key(rngs, where)


def draw_key(recipe: Recipe, source, rng_collection: str, operands, where: str):
    """A stochastic-rounding key for one GEMM call of `recipe` from `source` (nnx.Rngs: its `rng_collection`
    stream; nnx.RngStream; a PRNG key, used as is), or None when the call needs none.

    A stream is left alone where the call is forward only and its fprop operands round deterministically (the key
    would only serve the backward): in eager calls, and where the stream cannot be advanced because it belongs to
    an outer trace (a model closed over by `jax.jit`: plain jit inference works). A differentiated call, or one
    whose fprop rounds stochastically, draws; from a stream of an outer trace that raises ValueError saying to
    pass the model through the nnx transforms (nnx.jit / nnx.grad / nnx.scan, which carry the stream as state) or
    a key (``rngs=key``).
    """
    if recipe.quantized:  # before any key lookup: one error whatever the keys
        refuse_forward_mode(where, operands)
    if not recipe.needs_key:
        return None
    if isinstance(source, jax.Array):
        return source
    if isinstance(source, nnx.Rngs):
        source = source[rng_collection]
    if not isinstance(source, nnx.RngStream):
        raise TypeError(f"{where}: rngs must be an nnx.Rngs, nnx.RngStream or a PRNG key, got "
                        f"{type(source).__name__}")
    diff = None if recipe.fprop_needs_key else differentiated(*operands)
    if diff is False:
        return None
    try:
        return source()
    except TraceContextError as e:
        if diff is None and not recipe.fprop_needs_key:
            return None  # forward only as far as can be told: a differentiated call raises for the missing key
        raise ValueError(f"{where}: recipe {recipe.name!r} needs a stochastic-rounding key, but the layer's rng "
                         f"stream ({rng_collection!r}) belongs to an outer trace (a model closed over by jax.jit / "
                         "jax.grad) and cannot advance here. Pass the model through nnx.jit / nnx.grad / nnx.scan "
                         "(they carry the stream as state), or give the call a key: layer(x, rngs=key)") from e


def quantize_key(layer, rngs: RngsLike, operands=()):
    """The stochastic-rounding key of one call of `layer` (a module with ``recipe``, ``rngs`` from `quantize_stream`
    and ``rng_collection``) on `operands` (x, kernel, ...): `draw_key` from the call's `rngs` (Rngs, RngStream or a
    key), or from the layer's own stream when `rngs` is None. None when the recipe needs none, and for forward-only
    calls whose fprop rounds deterministically (the stream is left alone, see `draw_key`).

    Raises TypeError for `rngs` of another type (`check_rngs`, whatever the recipe) and for forward-mode
    differentiation (`jax_fp4._src.vjp_util.refuse_forward_mode`: checked before the key is looked up)."""
    where = f"{type(layer).__module__}.{type(layer).__qualname__}"
    check_rngs(rngs, where)
    if layer.recipe.quantized:
        refuse_forward_mode(where, operands)
    if not layer.recipe.needs_key:
        return None
    return draw_key(layer.recipe, layer.rngs if rngs is None else rngs, layer.rng_collection, operands, where)


def make_norm(kind, num_features, epsilon, dtype, param_dtype, rngs):
    """An nnx.LayerNorm or nnx.RMSNorm (`kind` in NORMS) over `num_features`; ValueError for another kind."""
    if kind == "layernorm":
        return nnx.LayerNorm(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if kind == "rmsnorm":
        return nnx.RMSNorm(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
