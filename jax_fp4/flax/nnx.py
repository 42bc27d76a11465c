"""Flax NNX layers whose GEMMs follow a jax_fp4 `Recipe`: `Dense`, `LayerNormDense`, `LayerNormMLP`.

Parameters (names, shapes, init) as Flax users expect::

  Dense            kernel [in, out] (lecun_normal), bias [out] (zeros)                 like nnx.Linear
  LayerNormDense   norm: {scale [in], bias [in]}, dense: {kernel, bias}
  LayerNormMLP     norm: {scale, bias}, up: {kernel [in, hidden] (GELU) or [in, 2 * hidden] (SwiGLU), bias},
                   down: {kernel [hidden, out], bias [out]}

The recipe (`jax_fp4.recipes`) names the format of each GEMM operand: fprop y = x @ kernel, dgrad dx = dy @ kernel.T,
wgrad dkernel = x.T @ dy. `recipes.BF16()` quantizes nothing (`Dense` is then `nnx.Linear`, bit for bit); the norms,
activations and bias additions always run unquantized in the compute dtype.

Stochastic rounding: when ``recipe.needs_key`` (e.g. `recipes.NVFP4()` rounds dy stochastically), each `Dense` keeps an
``nnx.RngStream`` tagged ``"quantize"`` and draws a fresh key on every differentiated call (and on every call when an
fprop operand rounds stochastically), inside `nnx.jit` / `nnx.grad` / `nnx.scan` too; forward-only calls of a
deterministic forward leave it alone, so a model closed over by `jax.jit` runs inference (`nnx_layers.draw_key`). It is
seeded at construction by one draw from ``rngs.quantize`` when the `Rngs` has a ``quantize`` stream; otherwise it is
derived from the params stream's current key and count without drawing from it (`quantize_stream`), so no stream of
the model advances and a model's weights and dropout masks are the same with a stochastic-rounding recipe as with
BF16. Reseed with ``nnx.reseed(model, quantize=seed)``; a ``rngs=`` call argument (Rngs, RngStream or key) takes
precedence, as in `nnx.Dropout`. Deterministic recipes keep no stream (``self.rngs`` is None).
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from jax_fp4 import diagnostics as _diagnostics
from jax_fp4.blocking import BlockingError
from jax_fp4.dense import dense
from jax_fp4.flax.layer_path import nnx_path
from jax_fp4.flax.nnx_layers import NORMS as NORMS  # the norm kinds the layers accept
from jax_fp4.flax.nnx_layers import RngsLike, check_recipe, make_norm, quantize_key, quantize_stream, split_rngs
from jax_fp4.recipes import Recipe

__all__ = ["Dense", "LayerNormDense", "LayerNormMLP"]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()
ACTIVATIONS = ("gelu", "swiglu")
class Dense(nnx.Module):
    """y = x @ kernel + bias over x's last axis, the GEMMs quantized as `recipe` says (`jax_fp4.dense`).

    A drop-in for `flax.nnx.Linear` (same parameters, init, dtype promotion); with `recipes.BF16()` it computes
    exactly what `nnx.Linear` computes.

    Args:
      in_features: K, the size of x's last axis.
      out_features: N.
      recipe: a `jax_fp4.recipes.Recipe` or its name (`recipes.by_name`); static: part of the module's graph
        definition, not of its state.
      use_bias: add a bias [N] (default True).
      dtype: the compute dtype (x, kernel and bias are cast to it before the GEMM); None infers it from x and the
        params with `promote_dtype`, as nnx.Linear does (bfloat16 x with float32 params computes in float32).
      param_dtype: dtype of kernel and bias (default float32).
      kernel_init, bias_init: initializers (default lecun_normal, zeros, as nnx.Linear).
      promote_dtype: the dtype promotion function, as nnx.Linear's.
      rng_collection: the rng stream the stochastic-rounding keys come from (default "quantize").
      rngs: `nnx.Rngs`; ``rngs.params`` initializes kernel then bias (the same draws as nnx.Linear); when
        ``recipe.needs_key`` the layer's own stream is seeded as the module docstring says (no other draw).
      kernel_metadata, bias_metadata: metadata of the `nnx.Param`s (e.g. sharding), as nnx.Linear's.

    Call: ``layer(x, *, rngs=None, x_amax=None)`` with x [..., K] -> [..., N] in the compute dtype (float32
    accumulation on the quantized path). ``rngs`` (Rngs, RngStream or a key) overrides the layer's stream for this
    call; ``x_amax``: ``jnp.max(jnp.abs(x))`` from x's producer, as `jax_fp4.dense`'s (not used by the diagnostics
    probe).

    Constraints (from the recipe's formats, raised as ValueError at trace time): MXFP8 blocks of 32 need K, N and the
    token count M = prod(x.shape[:-1]) divisible by 32 where they are blocked; NVFP4 blocks of 16 (16x16 for the
    2D-scaled weight) need multiples of 16.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: Recipe,
        use_bias: bool = True,
        dtype: tp.Any = None,
        param_dtype: tp.Any = jnp.float32,
        kernel_init: tp.Callable = default_kernel_init,
        bias_init: tp.Callable = default_bias_init,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        rng_collection: str = "quantize",
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        recipe = check_recipe(recipe, "jax_fp4.flax.nnx.Dense")
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype), **kernel_metadata)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.rng_collection = rng_collection
        self.rngs: nnx.RngStream | None = quantize_stream(recipe, rngs, rng_collection, "jax_fp4.flax.nnx.Dense")
        # a diagnostics probe (jax_fp4.flax.diagnostics.instrument sets it for one step; None: none, no state)
        self.quant_probe: nnx.Variable | None = nnx.data(None)

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None, x_amax: jax.Array | None = None) -> jax.Array:
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        probe = self.quant_probe  # set by jax_fp4.flax.diagnostics.instrument
        try:
            if probe is not None:
                return _diagnostics.dense(x, kernel, bias, recipe=self.recipe,
                                          key=quantize_key(self, rngs, (x, kernel, bias)), probe=probe[...])
            return dense(x, kernel, bias, recipe=self.recipe, key=quantize_key(self, rngs, (x, kernel, bias)),
                         x_amax=x_amax)
        except BlockingError as e:  # name the layer's module path in the model
            raise e.with_layer(nnx_path(self) or type(self).__name__) from None


class LayerNormDense(nnx.Module):
    """y = Dense(LayerNorm(x)): submodules ``norm`` (`nnx.LayerNorm` / `nnx.RMSNorm`, unquantized) and ``dense``.

    Args:
      in_features, out_features: K and N.
      recipe: the `jax_fp4.recipes.Recipe` of the GEMM.
      norm: "layernorm" (params ``scale``, ``bias`` [K]) or "rmsnorm" (``scale`` [K]).
      epsilon: the norm's epsilon (default 1e-6, as Flax's). The norm's statistics are computed in float32 whatever
        the dtype (Flax's normalization layers do that), so bfloat16 inputs are safe.
      use_bias, dtype, param_dtype, kernel_init, bias_init, rng_collection, rngs: as `Dense` (dtype and param_dtype
        also apply to the norm).

    Call: ``layer(x, *, rngs=None)``, x [..., K] -> [..., N]. The dense layer runs its own tensor-amax pass over the
    norm's output: handing it ``jnp.max(jnp.abs(y))`` from the norm's XLA fusion instead (``x_amax``) keeps the bits
    but was slower for nvfp4-fwd-mxfp8-bwd where measured (benchmarks/layer_amax.py; docs/performance.md, "Tensor
    amax from the producer").
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: Recipe, norm: str = "layernorm",
                 epsilon: float = 1e-6, use_bias: bool = True, dtype: tp.Any = None,
                 param_dtype: tp.Any = jnp.float32, kernel_init: tp.Callable = default_kernel_init,
                 bias_init: tp.Callable = default_bias_init, rng_collection: str = "quantize", rngs: nnx.Rngs):
        recipe = check_recipe(recipe, "jax_fp4.flax.nnx.LayerNormDense")
        self.norm = make_norm(norm, in_features, epsilon, dtype, param_dtype, rngs)
        self.dense = Dense(in_features, out_features, recipe=recipe, use_bias=use_bias, dtype=dtype,
                           param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
                           rng_collection=rng_collection, rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None) -> jax.Array:
        return self.dense(self.norm(x), rngs=rngs)


class LayerNormMLP(nnx.Module):
    """y = down(act(up(LayerNorm(x)))): a transformer MLP block whose up and down projections follow `recipe`.

    Submodules: ``norm`` (unquantized, float32 statistics), ``up`` (`Dense` [in, hidden], or [in, 2 * hidden] for
    SwiGLU), ``down`` (`Dense` [hidden, out]).

    SwiGLU uses one fused up projection: ``up.kernel[:, :hidden]`` is the gate and ``up.kernel[:, hidden:]`` the
    linear half, h = silu(gate) * linear. One kernel means x is quantized once for both halves (one GEMM, as TE's
    fused ``wi`` kernel); to import separate gate / up weights concatenate them along the output axis. With NVFP4's
    16x16 weight blocks the halves share no block when hidden % 16 == 0.

    Args:
      in_features: K, the model width.
      hidden_features: the MLP width (per half for SwiGLU).
      out_features: the output width (default in_features).
      recipe: the `jax_fp4.recipes.Recipe` of both projections.
      activation: "gelu" (tanh approximation, `jax.nn.gelu`'s and `flax.nnx.gelu`'s default) or "swiglu".
      norm, epsilon: as `LayerNormDense`.
      use_bias: biases on both projections (default True).
      dtype, param_dtype, kernel_init, bias_init, rng_collection, rngs: as `Dense`, for both projections. The
        activation runs in the compute dtype.
      down_kernel_init, down_bias_init: the down projection's initializers when they differ from ``kernel_init`` /
        ``bias_init`` (default None: the same), e.g. another sharding annotation: Megatron-style tensor parallelism
        splits ``up`` by columns and ``down`` by rows, ``kernel_init=nnx.with_partitioning(init, (None, "tensor"))``,
        ``down_kernel_init=nnx.with_partitioning(init, ("tensor", None))``.

    Call: ``layer(x, *, rngs=None)``, x [..., in] -> [..., out]; a key passed as ``rngs`` is split between up and
    down. Each projection runs its own tensor-amax pass (see `LayerNormDense`).
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *, recipe: Recipe,
                 activation: str = "gelu", norm: str = "layernorm", epsilon: float = 1e-6, use_bias: bool = True,
                 dtype: tp.Any = None, param_dtype: tp.Any = jnp.float32,
                 kernel_init: tp.Callable = default_kernel_init, bias_init: tp.Callable = default_bias_init,
                 rng_collection: str = "quantize", rngs: nnx.Rngs, down_kernel_init: tp.Callable | None = None,
                 down_bias_init: tp.Callable | None = None):
        recipe = check_recipe(recipe, "jax_fp4.flax.nnx.LayerNormMLP")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        out_features = in_features if out_features is None else out_features
        self.activation = activation
        self.hidden_features = hidden_features
        common = dict(recipe=recipe, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                      bias_init=bias_init, rng_collection=rng_collection, rngs=rngs)
        self.norm = make_norm(norm, in_features, epsilon, dtype, param_dtype, rngs)
        self.up = Dense(in_features, hidden_features * (2 if activation == "swiglu" else 1), **common)
        common["kernel_init"] = kernel_init if down_kernel_init is None else down_kernel_init
        common["bias_init"] = bias_init if down_bias_init is None else down_bias_init
        self.down = Dense(hidden_features, out_features, **common)

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None) -> jax.Array:
        r_up, r_down = split_rngs(rngs, 2)
        h = self.up(self.norm(x), rngs=r_up)
        if self.activation == "swiglu":
            gate, linear = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * linear
        else:
            h = jax.nn.gelu(h)
        return self.down(h, rngs=r_down)
