"""Helpers of the Flax NNX layers (`jax_fp4.flax.nnx`, `jax_fp4.flax.moe`): recipe checks, the stochastic-rounding
rng stream of a layer and the norm sub-layer."""

from __future__ import annotations

import zlib

import jax
from flax import nnx

from jax_fp4.recipes import Recipe, resolve

__all__ = ["NORMS", "RngsLike", "check_recipe", "make_norm", "quantize_key", "quantize_stream", "split_rngs"]

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


def quantize_key(layer, rngs: RngsLike):
    """The stochastic-rounding key of one call of `layer` (a module with ``recipe``, ``rngs`` from `quantize_stream`
    and ``rng_collection``): None when the recipe needs none, else a fresh draw from the call's `rngs` (Rngs: its
    ``rng_collection`` stream; RngStream; a key, used as is), or from the layer's own stream when `rngs` is None."""
    if not layer.recipe.needs_key:
        return None
    rngs = layer.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
        return rngs[layer.rng_collection]()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    if isinstance(rngs, jax.Array):
        return rngs
    raise TypeError(f"rngs must be an nnx.Rngs, nnx.RngStream or a PRNG key, got {type(rngs).__name__}")


def make_norm(kind, num_features, epsilon, dtype, param_dtype, rngs):
    """An nnx.LayerNorm or nnx.RMSNorm (`kind` in NORMS) over `num_features`; ValueError for another kind."""
    if kind == "layernorm":
        return nnx.LayerNorm(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if kind == "rmsnorm":
        return nnx.RMSNorm(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
