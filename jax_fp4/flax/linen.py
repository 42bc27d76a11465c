"""Flax Linen layers whose GEMMs follow a jax_fp4 `Recipe`: `Dense`, `LayerNormDense`, `LayerNormMLP`, `Einsum`.

The Linen counterparts of `jax_fp4.flax.nnx`, with the same numerics and parameter trees::

  Dense            {kernel [in, features], bias [features]}                              like nn.Dense
  LayerNormDense   {norm: {scale, bias}, dense: {kernel, bias}}
  LayerNormMLP     {norm: {scale, bias}, up: {kernel [in, hidden | 2 * hidden], bias}, down: {kernel, bias}}

Stochastic rounding: when ``recipe.needs_key`` each `Dense` call draws ``self.make_rng("quantize")`` (Linen falls back
to the "params" stream during ``init``); pass ``rngs={"quantize": key}`` to ``apply``, a new key per step. Linen
derives every stream from its name and the module path, so this stream leaves "dropout" and "params" untouched.
Forward-only calls (inference) need no "quantize" rng unless an fprop operand rounds stochastically.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.errors import InvalidRngError
from flax.linen.dtypes import promote_dtype

from jax_fp4._src.vjp_util import refuse_forward_mode
from jax_fp4.blocking import BlockingError
from jax_fp4.dense import dense
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.layer_path import linen_path
from jax_fp4.flax.nnx_layers import differentiated
from jax_fp4.policy import Policy
from jax_fp4.recipes import Recipe, resolve

__all__ = ["Dense", "LayerNormDense", "LayerNormMLP", "Einsum"]

default_kernel_init = nn.initializers.lecun_normal()
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")


def _norm(kind, epsilon, dtype, param_dtype):
    if kind == "layernorm":
        return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name="norm")
    if kind == "rmsnorm":
        return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name="norm")
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class Dense(nn.Module):
    """y = x @ kernel + bias over x's last axis, the GEMMs quantized as `recipe` says (`jax_fp4.dense`).

    A drop-in for `flax.linen.Dense` (same params ``kernel`` [in, features] / ``bias`` [features], init and dtype
    promotion); with `recipes.BF16()` it computes exactly what nn.Dense computes.

    Attributes:
      features: N, the number of output features.
      recipe: a `jax_fp4.recipes.Recipe` (frozen and hashable) or its name (`recipes.by_name`), or a
        `jax_fp4.policy.Policy`: the layer's recipe is then ``policy.resolve(self.path)`` (resolved when traced;
        the composite layers pass it to their sublayers).
      use_bias: add a bias (default True).
      dtype: compute dtype (None: promoted from x and the params, as nn.Dense).
      param_dtype: dtype of the params (default float32).
      kernel_init, bias_init: initializers (lecun_normal, zeros).
      promote_dtype: the dtype promotion function (Linen's variadic one).
      rng_collection: the rng stream of the stochastic-rounding keys (default "quantize").

    Call: ``module.apply(variables, x, x_amax=None)``: x [..., K] -> [..., N] in the compute dtype; ``x_amax``:
    ``jnp.max(jnp.abs(x))`` from x's producer, as `jax_fp4.dense`'s. Shape constraints as `jax_fp4.dense` (ValueError
    at trace time).
    """

    features: int
    recipe: Recipe
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    promote_dtype: Any = promote_dtype
    rng_collection: str = "quantize"

    @nn.compact
    def __call__(self, inputs: jax.Array, x_amax: jax.Array | None = None) -> jax.Array:
        if isinstance(self.recipe, Policy):
            recipe = self.recipe.resolve(self.path)
        else:
            recipe = resolve(self.recipe, "jax_fp4.flax.linen.Dense (or a jax_fp4.policy.Policy)")
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if recipe.quantized:  # before the rng lookup: one error whatever the rngs
            refuse_forward_mode("jax_fp4.flax.linen.Dense", inputs, kernel, bias)
        key = None
        if recipe.needs_key:
            try:
                key = self.make_rng(self.rng_collection)
            except InvalidRngError as e:
                if recipe.fprop_needs_key or differentiated(inputs, kernel, bias):
                    what = "an fprop" if recipe.fprop_needs_key else "a gradient"
                    layer = linen_path(self)
                    raise ValueError(
                        f"jax_fp4.flax.linen.Dense{'' if layer is None else ' ' + repr(layer)}: recipe {recipe.name!r} "
                        f"rounds {what} operand stochastically and needs keys from the {self.rng_collection!r} rng "
                        "collection: "
                        f"module.apply(variables, x, rngs={{{self.rng_collection!r}: key}}) (a new key per step, "
                        "e.g. jax.random.fold_in(key, step))") from e
                # forward-only calls need no key; a differentiated call the layer could not see as one (jax.grad
                # around jax.jit) raises in jax_fp4.dense's backward, naming the key
        try:
            return dense(inputs, kernel, bias, recipe=recipe, key=key, x_amax=x_amax)
        except BlockingError as e:  # name the layer's module path
            raise e.with_layer(linen_path(self)) from None


class LayerNormDense(nn.Module):
    """y = Dense(LayerNorm(x)): submodules ``norm`` (nn.LayerNorm / nn.RMSNorm, unquantized, float32 statistics) and
    ``dense``. Attributes as `Dense`, plus ``norm`` ("layernorm" | "rmsnorm") and ``epsilon`` (1e-6)."""

    features: int
    recipe: Recipe
    norm: str = "layernorm"
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    rng_collection: str = "quantize"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        y = _norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(inputs)
        return Dense(self.features, self.recipe, use_bias=self.use_bias, dtype=self.dtype,
                     param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
                     rng_collection=self.rng_collection, name="dense")(y)


class LayerNormMLP(nn.Module):
    """y = down(act(up(LayerNorm(x)))), the projections following `recipe` (see `jax_fp4.flax.nnx.LayerNormMLP`).

    Submodules ``norm``, ``up`` (kernel [in, hidden], or [in, 2 * hidden] for SwiGLU: gate = [:, :hidden], linear =
    [:, hidden:], h = silu(gate) * linear) and ``down`` (kernel [hidden, out]).

    Attributes:
      hidden_features: the MLP width (per half for SwiGLU).
      recipe: the `jax_fp4.recipes.Recipe` of both projections.
      out_features: output width (None: x's last axis).
      activation: "gelu" (tanh approximation) or "swiglu".
      norm, epsilon, use_bias, dtype, param_dtype, kernel_init, bias_init, rng_collection: as `LayerNormDense`.
    """

    hidden_features: int
    recipe: Recipe
    out_features: int | None = None
    activation: str = "gelu"
    norm: str = "layernorm"
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    rng_collection: str = "quantize"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        out = jnp.shape(inputs)[-1] if self.out_features is None else self.out_features
        kw = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                  bias_init=self.bias_init, rng_collection=self.rng_collection)
        swiglu = self.activation == "swiglu"
        h = _norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(inputs)
        h = Dense(self.hidden_features * (2 if swiglu else 1), self.recipe, name="up", **kw)(h)
        if swiglu:
            gate, linear = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * linear
        else:
            h = jax.nn.gelu(h)
        return Dense(out, self.recipe, name="down", **kw)(h)


class Einsum(nn.Einsum):
    """`flax.linen.Einsum` whose contraction follows `recipe` (`jax_fp4.flax.einsum.make_einsum`): same attributes,
    parameters ({kernel: shape, bias}) and call, plus ``recipe`` and ``rng_collection``.

    Attributes:
      shape, einsum_str, use_bias, dtype, param_dtype, kernel_init, bias_init, promote_dtype,
        preferred_element_type: as `flax.linen.Einsum` (``precision`` applies to BF16 only: a quantized contraction's
        operand formats are the recipe's).
      recipe: a `jax_fp4.recipes.Recipe`, its name, or a `jax_fp4.policy.Policy` (resolved from ``self.path``).
      rng_collection: the rng stream of the stochastic-rounding keys (default "quantize"; ``apply(...,
        rngs={"quantize": key})``).

    Call: ``module.apply(variables, x, einsum_str=None)``; two operands (x and the kernel), the contraction as
    `jax_fp4.dot_general` computes it: the contracted axes flatten into K, whose blocks lie within the last
    contracted axis (BlockingError otherwise, naming the layer), the free axes into M and N. BF16 computes what
    `flax.linen.Einsum` computes.
    """

    recipe: Recipe | Policy | None = None
    rng_collection: str = "quantize"

    @nn.compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        if self.recipe is None:
            raise TypeError("jax_fp4.flax.linen.Einsum: give recipe= (a Recipe, its name or a Policy)")
        recipe = self.recipe.resolve(self.path) if isinstance(self.recipe, Policy) else resolve(
            self.recipe, "jax_fp4.flax.linen.Einsum")
        if (self.einsum_str is None) == (einsum_str is None):
            raise ValueError("jax_fp4.flax.linen.Einsum: give einsum_str to the constructor or to the call, not both")
        einsum_str = (self.einsum_str if einsum_str is None else einsum_str).replace(" ", "")
        if "->" not in einsum_str or einsum_str.count(",") != 1:
            raise ValueError(f"jax_fp4.flax.linen.Einsum: einsum_str {einsum_str!r} must be explicit (\"->\") with "
                             "exactly two operands (x and the kernel)")
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias_shape, broadcast_shape = self._get_bias_shape(einsum_str, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if recipe.quantized:
            refuse_forward_mode("jax_fp4.flax.linen.Einsum", inputs, kernel)
        try:
            y = make_einsum(recipe, rng_collection=self.rng_collection)(
                einsum_str, inputs, kernel, precision=self.precision,
                preferred_element_type=self.preferred_element_type)
        except BlockingError as e:
            raise e.with_layer(linen_path(self)) from None
        return y if bias is None else y + jnp.reshape(bias, broadcast_shape)
