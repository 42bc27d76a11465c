"""`jax_fp4.flax.moe.MoEMLP`: top-k routed experts through the quantized grouped GEMM (CPU).

* dispatch: every assignment gets its own buffer row, expert groups contiguous in token order and padded to the
  alignment, within the static capacity;
* BF16 recipe == a float64 per-token evaluation of the same routing and experts;
* training: under nnx.jit + nnx.value_and_grad with AdamW, the loss (MSE + 0.01 * the load-balancing loss) falls
  over a few steps, gradients finite, for MXFP8 (NVFP4 with stochastic rounding and RHT: slow);
* construction / trace-time errors.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jax_fp4 import recipes  # noqa: E402
from jax_fp4.flax.moe import MoEMLP, dispatch, group_alignment  # noqa: E402

D, H, E, TOP_K = 64, 64, 4, 2


def test_group_alignment():
    assert group_alignment(recipes.BF16()) == 1
    assert group_alignment(recipes.MXFP8()) == 32
    assert group_alignment(recipes.NVFP4()) == 16
    assert group_alignment(recipes.NVFP4Fwd_MXFP8Bwd()) == 32


@pytest.mark.parametrize("alignment", [1, 32])
def test_dispatch(rng, alignment):
    t = 37
    experts = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    experts[:, 0] = np.where(rng.random(t) < 0.5, 0, experts[:, 0])  # skew towards expert 0
    experts[experts == 3] = 2  # expert 3 empty (top-2 may then repeat expert 2: allowed by dispatch)
    rows, sizes, cap = jax.jit(dispatch, static_argnums=(1, 2))(experts, E, alignment)
    rows, sizes = np.asarray(rows), np.asarray(sizes)
    counts = np.bincount(experts.reshape(-1), minlength=E)
    np.testing.assert_array_equal(sizes, -(-counts // alignment) * alignment)
    assert sizes.sum() <= cap == -(-(t * TOP_K + E * (alignment - 1)) // alignment) * alignment
    assert len(set(rows.reshape(-1).tolist())) == t * TOP_K  # one row per assignment
    start = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(E):
        tok, slot = np.nonzero(experts == e)
        r = rows[tok, slot]
        np.testing.assert_array_equal(np.sort(r), start[e] + np.arange(counts[e]))  # contiguous from the start
        assert np.all(np.diff(r[np.argsort(tok, kind="stable")]) > 0)  # in token order


def _reference(layer, x):
    """float64 y of a BF16-recipe layer from its parameters: route, then every (token, expert) pair by hand."""
    x2 = np.asarray(layer.norm(x), np.float64).reshape(-1, D)
    probs, weights, experts = (np.asarray(a) for a in layer.route(jnp.asarray(x2, jnp.float32)))
    up, down = (np.asarray(k[...], np.float64) for k in (layer.up.kernel, layer.down.kernel))
    y = np.zeros((x2.shape[0], layer.out_features))
    for t in range(x2.shape[0]):
        for j in range(TOP_K):
            e = experts[t, j]
            gate, lin = np.split(x2[t] @ up[e], 2)
            y[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * lin) @ down[e])
    return y.reshape(*x.shape[:-1], -1)


def test_bf16_recipe_matches_per_token_evaluation():
    layer = MoEMLP(D, H, E, recipe=recipes.BF16(), top_k=TOP_K, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 10, D)), jnp.float32)
    y = layer(x)  # eagerly, as the reference's routing (a jitted bfloat16 router may round its logits differently)
    assert y.shape == (3, 10, D) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _reference(layer, x), rtol=1e-4, atol=1e-5)


def _train(recipe, steps=6, activation="swiglu"):
    layer = MoEMLP(D, H, E, recipe=recipe, top_k=TOP_K, activation=activation, dtype=jnp.bfloat16,
                   rngs=nnx.Rngs(params=0, quantize=1))
    opt = nnx.Optimizer(layer, optax.adamw(3e-3), wrt=nnx.Param)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 24, D)), jnp.bfloat16)
    target = jnp.asarray(np.tanh(rng.standard_normal((4, 24, D))), jnp.float32)

    @nnx.jit
    def step(layer, opt, x, target):
        def loss_fn(layer):
            y, aux = layer(x, return_aux_loss=True)
            return jnp.mean((y.astype(jnp.float32) - target) ** 2) + 0.01 * aux

        loss, grads = nnx.value_and_grad(loss_fn)(layer)
        opt.update(layer, grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        return loss, finite

    out = [step(layer, opt, x, target) for _ in range(steps)]
    losses = [float(loss) for loss, _ in out]
    assert all(bool(f) for _, f in out), losses
    assert losses[-1] < 0.8 * losses[0] and all(np.isfinite(losses)), losses
    return losses


@pytest.mark.parametrize(
    "recipe, activation",
    [
        pytest.param(recipes.MXFP8(), "swiglu", id="mxfp8-swiglu"),
        pytest.param(recipes.BF16(), "gelu", id="bf16-gelu"),
        pytest.param(recipes.NVFP4(), "swiglu", id="nvfp4-swiglu", marks=pytest.mark.slow),
        pytest.param(recipes.NVFP4Fwd_MXFP8Bwd(), "gelu", id="nvfp4-fwd-mxfp8-bwd-gelu", marks=pytest.mark.slow),
    ],
)
def test_training_loss_falls(recipe, activation):
    _train(recipe, activation=activation)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=5), "top_k"),
        (dict(activation="relu"), "activation"),
        (dict(recipe=recipes.MXFP8(), alignment=16), "multiple of 32"),
        (dict(recipe=5), "Recipe"),
        (dict(recipe="fp4"), "unknown recipe"),
    ],
)
def test_construction_errors(kwargs, match):
    kwargs = dict(recipe=recipes.BF16()) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        MoEMLP(D, H, E, rngs=nnx.Rngs(0), **kwargs)


def test_1x64_recipe_raises_at_trace_time():
    layer = MoEMLP(D, H, E, recipe=recipes.NVFP4_1x64(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fprop_x .* cannot quantize the grouped tokens"):
        nnx.eval_shape(lambda m: m(jnp.ones((8, D), jnp.bfloat16)), layer)
