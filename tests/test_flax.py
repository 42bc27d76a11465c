"""jax_fp4.flax on the CPU: NNX and Linen layers following a Recipe, and the drop-in dot_general.

* BF16: `nnx.Dense` == `flax.nnx.Linear` and `linen.Dense` == `flax.linen.Dense` bit for bit (same init draws, forward
  and gradients, also bfloat16 compute with float32 params);
* parameter names and shapes as Flax's (nnx.state / the Linen params tree, NNX and Linen trees equal);
* every recipe: the layers run under `nnx.jit` and their output and gradients (`nnx.value_and_grad`) are close to the
  same layer with the BF16 recipe and the same params (bounds per format, see `_bounds`) and differ from it (the
  recipe is applied);
* stochastic rounding: fresh keys per call from the "quantize" stream under `nnx.jit`, reproducible by reseeding;
* a short AdamW training run with NVFP4Fwd_MXFP8Bwd reduces the loss;
* `make_dot_general` in nnx.Linear / nn.Dense == the jax_fp4 layers; unsupported dimension numbers fall back to
  lax.dot_general;
* `import jax_fp4` does not import flax; `import jax_fp4.flax` without flax raises an ImportError naming the extra.

XLA's CPU compile time of the quantized reference kernels dominates (~2-9 s per quantized GEMM with its gradient), so
by default `Dense` runs every recipe, the norm and MLP layers MXFP8 (the cheapest) and LayerNormDense also NVFP4
(stochastic rounding through a sub-layer); the rest of the layer x recipe product is marked `slow` and runs only
when selected with ``-m slow`` (~70 s more).
"""

from __future__ import annotations

import pytest
from _optional_import import check_optional_import

pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import MXFP8 as MXFP8Format  # noqa: E402
from jax_fp4 import NVFP4 as NVFP4Format  # noqa: E402
from jax_fp4 import dense, recipes  # noqa: E402
from jax_fp4.flax import UnquantizedDotGeneralWarning, make_dot_general  # noqa: E402
from jax_fp4.flax import linen as flinen  # noqa: E402
from jax_fp4.flax import nnx as fnnx  # noqa: E402

B, T, IN, OUT, HID = 2, 32, 128, 64, 128  # M = 64 tokens: blocks of 32 (MXFP8 wgrad) and 16 (NVFP4, RHT) fit


def _x(rng, shape=(B, T, IN), dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _seed(rng):
    return int(rng.integers(2**31))


def _bits_equal(a, b):
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _assert_trees_bits_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for path, (u, v) in zip(jax.tree_util.tree_flatten_with_path(a)[0], zip(la, lb, strict=True), strict=True):
        assert _bits_equal(u, v), (jax.tree_util.keystr(path[0]), np.max(np.abs(np.float64(u) - np.float64(v))))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _shapes(tree):
    return jax.tree.map(jnp.shape, tree)


# ---- BF16 == Flax's own layers, bit for bit --------------------------------------------------------------------------
def _loss_and_grads(model, x, ct):
    """nnx.jit'ed (y, d(params), dx) of sum(model(x) * ct)."""

    @nnx.jit
    def f(model, x, ct):
        def loss(model, x):
            y = model(x)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        (_, y), (g, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
        return y, nnx.state(g, nnx.Param), dx

    return f(model, x, ct)


@pytest.mark.parametrize("x_dtype,dtype,use_bias", [
    (jnp.float32, None, True),
    (jnp.float32, jnp.bfloat16, True),   # bf16 compute, f32 params (mixed precision)
    (jnp.bfloat16, None, True),          # promoted to f32 by the f32 params
    (jnp.bfloat16, jnp.bfloat16, False),
])
def test_nnx_bf16_dense_is_linear(rng, x_dtype, dtype, use_bias):
    seed = _seed(rng)
    ours = fnnx.Dense(IN, OUT, recipe=recipes.BF16(), dtype=dtype, use_bias=use_bias, rngs=nnx.Rngs(seed))
    ref = nnx.Linear(IN, OUT, dtype=dtype, use_bias=use_bias, rngs=nnx.Rngs(seed))
    _assert_trees_bits_equal(nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param))  # the same init draws
    # Perturb the bias so it matters, copy into both.
    if use_bias:
        ref.bias[...] = _x(rng, (OUT,))
        nnx.update(ours, nnx.state(ref, nnx.Param))
    x = _x(rng, dtype=x_dtype)
    assert _bits_equal(ours(x), ref(x))
    ct = _x(rng, (B, T, OUT))
    _assert_trees_bits_equal(_loss_and_grads(ours, x, ct), _loss_and_grads(ref, x, ct))


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_linen_bf16_dense_is_nn_dense(rng, dtype):
    x, ct = _x(rng), _x(rng, (B, T, OUT))
    ours, ref = flinen.Dense(OUT, recipes.BF16(), dtype=dtype), nn.Dense(OUT, dtype=dtype)
    key = jax.random.key(_seed(rng))
    v_ours, v_ref = ours.init(key, x), ref.init(key, x)
    _assert_trees_bits_equal(v_ours, v_ref)
    v = {"params": {"kernel": v_ref["params"]["kernel"], "bias": _x(rng, (OUT,))}}

    def run(module):
        return jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(module.apply(v, x).astype(jnp.float32) * ct),
                                          argnums=(0, 1)))(v, x)

    assert _bits_equal(ours.apply(v, x), ref.apply(v, x))
    _assert_trees_bits_equal(run(ours), run(ref))


# ---- parameter names and shapes --------------------------------------------------------------------------------------
def test_param_names_and_shapes():
    r, rngs = recipes.MXFP8(), nnx.Rngs(0)
    lin = {"kernel": (IN, OUT), "bias": (OUT,)}
    norm = {"scale": (IN,), "bias": (IN,)}
    expected = {
        "dense": (fnnx.Dense(IN, OUT, recipe=r, rngs=rngs), lin),
        "dense_nobias": (fnnx.Dense(IN, OUT, recipe=r, use_bias=False, rngs=rngs), {"kernel": (IN, OUT)}),
        "lnd": (fnnx.LayerNormDense(IN, OUT, recipe=r, rngs=rngs), {"norm": norm, "dense": lin}),
        "rmsd": (fnnx.LayerNormDense(IN, OUT, recipe=r, norm="rmsnorm", rngs=rngs),
                 {"norm": {"scale": (IN,)}, "dense": lin}),
        "mlp_gelu": (fnnx.LayerNormMLP(IN, HID, recipe=r, rngs=rngs),
                     {"norm": norm, "up": {"kernel": (IN, HID), "bias": (HID,)},
                      "down": {"kernel": (HID, IN), "bias": (IN,)}}),
        "mlp_swiglu": (fnnx.LayerNormMLP(IN, HID, OUT, recipe=r, activation="swiglu", rngs=rngs),
                       {"norm": norm, "up": {"kernel": (IN, 2 * HID), "bias": (2 * HID,)},
                        "down": {"kernel": (HID, OUT), "bias": (OUT,)}}),
    }
    linen = {
        "dense": flinen.Dense(OUT, r), "dense_nobias": flinen.Dense(OUT, r, use_bias=False),
        "lnd": flinen.LayerNormDense(OUT, r), "rmsd": flinen.LayerNormDense(OUT, r, norm="rmsnorm"),
        "mlp_gelu": flinen.LayerNormMLP(HID, r), "mlp_swiglu": flinen.LayerNormMLP(HID, r, OUT, activation="swiglu"),
    }
    x = jnp.zeros((B, T, IN))
    for name, (model, shapes) in expected.items():
        state = nnx.state(model)
        assert _shapes(nnx.to_pure_dict(state)) == shapes, name  # only Params: MXFP8 keeps no rng stream
        assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state)), name
        params = jax.eval_shape(linen[name].init, jax.random.key(0), x)
        assert set(params) == {"params"} and _shapes(params["params"]) == shapes, name
    # a recipe with stochastic rounding adds the layer's "quantize" stream (RngKey / RngCount), not a Param
    sr = fnnx.LayerNormMLP(IN, HID, recipe=recipes.NVFP4(), rngs=nnx.Rngs(0))
    assert _shapes(nnx.to_pure_dict(nnx.state(sr, nnx.Param))) == expected["mlp_gelu"][1]
    streams = nnx.state(sr, nnx.RngState)
    assert set(nnx.to_pure_dict(streams)) == {"up", "down"}
    assert {v.tag for v in jax.tree.leaves(streams, is_leaf=lambda v: isinstance(v, nnx.Variable))} == {"quantize"}


def test_bad_arguments():
    with pytest.raises(TypeError, match="Recipe"):
        fnnx.Dense(IN, OUT, recipe=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        fnnx.LayerNormMLP(IN, HID, recipe=recipes.BF16(), activation="relu6", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="norm"):
        fnnx.LayerNormDense(IN, OUT, recipe=recipes.BF16(), norm="batchnorm", rngs=nnx.Rngs(0))
    # no "quantize" stream: derived from the params stream without drawing from it
    fnnx.Dense(IN, OUT, recipe=recipes.NVFP4(), rngs=nnx.Rngs(params=0))
    fnnx.Dense(IN, OUT, recipe=recipes.MXFP8(), rngs=nnx.Rngs(params=0))  # deterministic: no stream needed
    # Linen: a missing "quantize" rng at apply time (init falls back to "params"): forward-only calls need none,
    # differentiated ones name the key
    layer = flinen.Dense(OUT, recipes.NVFP4())
    x = jnp.zeros((B, T, IN))
    params = jax.eval_shape(layer.init, jax.random.key(0), x)
    assert jax.eval_shape(layer.apply, params, x).shape == (B, T, OUT)
    with pytest.raises(ValueError, match="needs key"):
        jax.eval_shape(jax.grad(lambda x, p: layer.apply(p, x).sum()), x, params)
    sr_fprop = recipes.Recipe("sr-fprop", NVFP4Format(stochastic_rounding=True), NVFP4Format())
    params = jax.eval_shape(flinen.Dense(OUT, sr_fprop).init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"rngs=\{'quantize': key\}"):
        jax.eval_shape(flinen.Dense(OUT, sr_fprop).apply, params, x)
    # shapes the formats cannot block fail at trace time with the shape in the message
    with pytest.raises(ValueError, match="120"):
        jax.eval_shape(fnnx.Dense(120, OUT, recipe=recipes.MXFP8(), rngs=nnx.Rngs(0)), jnp.zeros((T, 120)))


# ---- every recipe vs BF16 with the same params -----------------------------------------------------------------------
def _bounds(recipe, n_gemms):
    """Relative Frobenius error bounds (forward, gradients) of a recipe's layer vs the float32 layer (BF16 recipe).

    Expected error of one quantized GEMM (two quantized operands; round-to-nearest error uniform in +-ulp/2):
    MXFP8 E4M3 (3 mantissa bits, relative ulp ~2^-3..2^-4) ~0.025 per operand, ~0.04 per GEMM; E5M2 twice that;
    NVFP4 E2M1 (1 mantissa bit, E4M3 block scales; 16x16 weight blocks, stochastic rounding of dy) ~0.1 per operand,
    ~0.17 per GEMM (measured 0.13-0.17). The bounds are 2x that for one GEMM and 3x for the MLP's chain of two (whose
    gradients also see the forward's error through the activation): loose enough for any seed, yet far below the O(1)
    errors of a wrong layout, a missing bias, an unquantized path (checked separately) or a transposed operand.
    """
    def per_gemm(*fmts):
        fmts = [f for f in fmts if f is not None]
        if any(isinstance(f, NVFP4Format) for f in fmts):
            return 0.17
        if any(isinstance(f, MXFP8Format) and f.element == "e5m2" for f in fmts):
            return 0.08
        return 0.04 if fmts else 0.0

    k = 2 if n_gemms == 1 else 3
    fwd = per_gemm(recipe.fprop_x, recipe.fprop_w)
    bwd = max(per_gemm(recipe.dgrad_dy, recipe.dgrad_w), per_gemm(recipe.wgrad_x, recipe.wgrad_dy))
    return k * fwd, k * (bwd if n_gemms == 1 else max(fwd, bwd))


LAYERS = {
    "dense": (1, lambda r, rngs: fnnx.Dense(IN, OUT, recipe=r, rngs=rngs)),
    "layernorm_dense": (1, lambda r, rngs: fnnx.LayerNormDense(IN, OUT, recipe=r, rngs=rngs)),
    "mlp_gelu": (2, lambda r, rngs: fnnx.LayerNormMLP(IN, HID, recipe=r, rngs=rngs)),
    "mlp_swiglu": (2, lambda r, rngs: fnnx.LayerNormMLP(IN, HID, OUT, recipe=r, activation="swiglu", rngs=rngs)),
}
FAST = {("dense", r) for r in recipes.RECIPES} | {(layer, "mxfp8") for layer in LAYERS} | {("layernorm_dense", "nvfp4")}
CASES = [pytest.param(layer, r, marks=() if (layer, r) in FAST else pytest.mark.slow)
         for layer in LAYERS for r in recipes.RECIPES if r != "bf16"]


@pytest.mark.parametrize("layer,recipe_name", CASES)
def test_recipe_close_to_bf16(request, rng, layer, recipe_name):
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow: the full layer x recipe product runs with -m slow")
    n_gemms, make = LAYERS[layer]
    recipe = recipes.by_name(recipe_name)
    seed = _seed(rng)
    model, ref = make(recipe, nnx.Rngs(seed)), make(recipes.BF16(), nnx.Rngs(seed))
    # non-trivial norm params and biases, the same in both
    params = jax.tree.map(lambda p: p + 0.1 * _x(rng, p.shape), nnx.state(model, nnx.Param))
    nnx.update(model, params)
    nnx.update(ref, params)
    x = _x(rng)
    y, g, dx = _loss_and_grads(model, x, ct := _x(rng, (B, T, OUT if layer != "mlp_gelu" else IN)))
    y_ref, g_ref, dx_ref = _loss_and_grads(ref, x, ct)
    fwd, bwd = _bounds(recipe, n_gemms)
    errs = {"y": _rel(y, y_ref), "dx": _rel(dx, dx_ref)}
    errs |= {jax.tree_util.keystr(p): _rel(a, b) for (p, a), b in
             zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref), strict=True)}
    assert all(np.isfinite(v).all() for v in jax.tree.leaves((y, g, dx)))
    assert errs["y"] < fwd and max(v for k, v in errs.items() if k != "y") < bwd, (fwd, bwd, errs)
    assert errs["y"] > 1e-4 and errs["dx"] > 1e-4, errs  # the recipe is applied


def test_linen_recipe_matches_nnx(rng):
    """The Linen MLP with the NNX MLP's params computes the same bits (deterministic recipe)."""
    recipe = recipes.MXFP8()
    model = fnnx.LayerNormMLP(IN, HID, OUT, recipe=recipe, activation="swiglu", rngs=nnx.Rngs(_seed(rng)))
    layer = flinen.LayerNormMLP(HID, recipe, OUT, activation="swiglu")
    params = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}
    x = _x(rng)
    assert _bits_equal(jax.jit(layer.apply)(params, x), nnx.jit(lambda m, x: m(x))(model, x))


# ---- stochastic rounding: fresh keys per call, reproducible by reseeding ---------------------------------------------
def test_nnx_stochastic_rounding_keys(rng):
    model = fnnx.Dense(IN, OUT, recipe=recipes.NVFP4(), rngs=nnx.Rngs(params=_seed(rng), quantize=7))
    x, ct = _x(rng), _x(rng, (B, T, OUT))

    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda model, x: jnp.sum(model(x) * ct), argnums=(0, 1))(model, x)

    g1, g2 = grads(model, x), grads(model, x)
    assert int(model.rngs.count[...]) == 2  # the stream advanced once per call, inside nnx.jit
    assert not np.array_equal(g1[0].kernel[...], g2[0].kernel[...]) and not np.array_equal(g1[1], g2[1])
    nnx.reseed(model, quantize=7)
    _assert_trees_bits_equal(grads(model, x), g1)
    _assert_trees_bits_equal(grads(model, x), g2)


def test_linen_stochastic_rounding_keys(rng):
    """The Linen key comes from make_rng("quantize"). A recipe quantizing only dgrad, with stochastic rounding of dy,
    keeps the compile cheap."""
    recipe = recipes.Recipe("sr-dgrad", dgrad_dy=NVFP4Format(stochastic_rounding=True), dgrad_w=NVFP4Format())
    layer = flinen.Dense(OUT, recipe)
    x, ct = _x(rng), _x(rng, (B, T, OUT))
    params = layer.init(jax.random.key(0), x)
    dx = jax.jit(jax.grad(lambda x, k: jnp.sum(layer.apply(params, x, rngs={"quantize": k}) * ct)))
    a, b, c = dx(x, jax.random.key(1)), dx(x, jax.random.key(2)), dx(x, jax.random.key(1))
    assert not np.array_equal(a, b) and _bits_equal(a, c)


# ---- a short training run --------------------------------------------------------------------------------------------
class _MLP(nnx.Module):
    def __init__(self, recipe, rngs):
        self.fc1 = fnnx.Dense(IN, HID, recipe=recipe, rngs=rngs)
        self.fc2 = fnnx.Dense(HID, OUT, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def test_training_loss_decreases(rng):
    optax = pytest.importorskip("optax")
    x = _x(rng, (B * T, IN), jnp.bfloat16)
    teacher = jnp.asarray(rng.standard_normal((IN, OUT)) / np.sqrt(IN), jnp.float32)
    target = jnp.tanh(x.astype(jnp.float32) @ teacher)
    model = _MLP(recipes.NVFP4Fwd_MXFP8Bwd(), nnx.Rngs(_seed(rng)))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(30)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.25 * losses[0], losses


# ---- the drop-in dot_general -----------------------------------------------------------------------------------------
def test_make_dot_general_in_flax_modules(rng):
    recipe = recipes.MXFP8()
    dg = make_dot_general(recipe)
    seed, x, ct = _seed(rng), _x(rng), _x(rng, (B, T, OUT))
    linear = nnx.Linear(IN, OUT, use_bias=False, dot_general=dg, rngs=nnx.Rngs(seed))
    ours = fnnx.Dense(IN, OUT, recipe=recipe, use_bias=False, rngs=nnx.Rngs(seed))
    _assert_trees_bits_equal(_loss_and_grads(linear, x, ct), _loss_and_grads(ours, x, ct))
    # Linen nn.Dense with the drop-in == jax_fp4.flax.linen.Dense (bias added after the float32 GEMM output)
    params = flinen.Dense(OUT, recipe).init(jax.random.key(seed), x)
    assert _bits_equal(jax.jit(nn.Dense(OUT, dot_general=dg).apply)(params, x),
                       jax.jit(flinen.Dense(OUT, recipe).apply)(params, x))
    # several output axes (nnx.LinearGeneral-style kernel [K, N1, N2])
    w, dn = _x(rng, (IN, 2, 32)), (((2,), (0,)), ((), ()))
    assert _bits_equal(jax.jit(lambda x, w: dg(x, w, dn))(x, w),
                       jax.jit(lambda x, w: dense(x, w.reshape(IN, 64), recipe=recipe).reshape(B, T, 2, 32))(x, w))
    assert jax.eval_shape(lambda x, w: dg(x, w, dn, preferred_element_type=jnp.bfloat16), x, w).dtype == jnp.bfloat16


def test_make_dot_general_fallbacks(rng):
    dg = make_dot_general(recipes.NVFP4Fwd_MXFP8Bwd())
    ints = jnp.arange(32 * 16, dtype=jnp.int32).reshape(32, 16)
    with pytest.warns(UnquantizedDotGeneralWarning, match="non-floating"):
        assert _bits_equal(dg(ints, ints.T, (((1,), (0,)), ((), ()))), ints @ ints.T)
    a, v = _x(rng, (32, 16)), _x(rng, (16,))
    matvec = (((1,), (0,)), ((), ()))
    with pytest.warns(UnquantizedDotGeneralWarning, match="no free dimension"):
        assert _bits_equal(dg(a, v, matvec), jax.lax.dot_general(a, v, matvec))
    with pytest.raises(ValueError, match="no free dimension"):
        make_dot_general(recipes.MXFP8(), strict=True)(a, v, matvec)
    # BF16 is lax.dot_general, precision and preferred_element_type passed through
    e, f = _x(rng, (8, 16), jnp.bfloat16), _x(rng, (16, 8), jnp.bfloat16)
    kw = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    assert _bits_equal(make_dot_general(recipes.BF16())(e, f, dn, **kw), jax.lax.dot_general(e, f, dn, **kw))
    # stochastic rounding without a key: forward-only calls need none, differentiated ones say so
    x, w = _x(rng, (T, IN)), _x(rng, (IN, OUT))
    assert jax.eval_shape(lambda a, b: make_dot_general(recipes.NVFP4())(a, b, dn), x, w).shape == (T, OUT)
    with pytest.raises(ValueError, match="needs key"):
        jax.eval_shape(jax.grad(lambda a, b: make_dot_general(recipes.NVFP4())(a, b, dn).sum()), x, w)
    with pytest.raises(TypeError, match="Recipe"):
        make_dot_general(3)


# ---- imports ---------------------------------------------------------------------------------------------------------
def test_imports():
    check_optional_import("flax", "flax")
