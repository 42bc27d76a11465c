"""`jax_fp4.ragged_dot`: the quantized grouped GEMM (MoE experts) with its custom VJP, on the CPU.

* BF16 recipe == `jax.lax.ragged_dot` bit for bit, forward and gradients;
* quantized recipes: y, dx and dw under jit(vjp) against float64 products of the same quantized operands, group by
  group. The operands are reproduced with the documented calls (key -> split(key, 3); x and dy through
  `grouped_quantize_rowwise_columnwise` over the token groups, w per expert through
  `quantize_rowwise_columnwise` with split(kw, G)[g]) and decoded exactly (`_gemm_util.decode`, docs/numerics.md). The
  bound is `_gemm_util`'s (Higham eq. 3.5: gamma over the contracted length, plus the tensor scales' two roundings
  per NVFP4 operand, plus the bfloat16 cast), nothing tuned. Contracted lengths: K (fprop), N (dgrad), M_g (wgrad
  of group g): an implementation that adds masked-out zero terms (XLA:CPU expands the ragged operand per group)
  rounds no more, since fl(a + 0) = a exactly, so the recursive-summation bound over the real terms still holds;
* group sizes with empty groups and rows past sum(group_sizes) (zero output and zero dx there); traced misaligned
  groups give a NaN dw for that group only; the residuals are quantized (no bfloat16 copy of x or w); errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gemm_util import DGRAD, FPROP, WGRAD, assert_within, cast_bound, operand_bound
from _quantize_util import bits

import jax_fp4
from jax_fp4 import recipes

T, K, N, G = 160, 64, 32, 4
SIZES = np.array([32, 0, 64, 32], np.int32)  # sum 128 < T: 32 rows past the last group


def _data(seed, t=T):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) * K**-0.5, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((t, N)), jnp.bfloat16)
    return x, w, dy, jax.random.key(int(rng.integers(2**31)))


@functools.partial(jax.jit, static_argnames=("recipe",))
def ragged_vjp(x, w, gs, dy, key, recipe):
    y, vjp = jax.vjp(lambda x, w: jax_fp4.ragged_dot(x, w, gs, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))


@functools.partial(jax.jit, static_argnames=("recipe",))
def operands(x, w, gs, dy, key, recipe):
    """The six GEMM operands, reproduced as jax_fp4/grouped_gemm.py documents."""
    kx, kw, kdy = jax.random.split(key, 3)
    x_fprop, x_wgrad, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, recipe.fprop_x, recipe.wgrad_x, key=kx)
    dy_dgrad, dy_wgrad, _ = jax_fp4.grouped_quantize_rowwise_columnwise(dy, gs, recipe.dgrad_dy, recipe.wgrad_dy,
                                                                        key=kdy)
    weight = lambda wg, kg: jax_fp4.quantize_rowwise_columnwise(wg, recipe.dgrad_w, recipe.fprop_w, key=kg)[:2]  # noqa: E731
    w_dgrad, w_fprop = jax.vmap(weight)(w, jax.random.split(kw, w.shape[0]))
    return dict(x_fprop=x_fprop, w_fprop=w_fprop, dy_dgrad=dy_dgrad, w_dgrad=w_dgrad, x_wgrad=x_wgrad,
                dy_wgrad=dy_wgrad)


def _expert(q, g):
    return jax.tree.map(lambda a: a[g], q)


def check_ragged(outs, ops, sizes, what):
    """(y, dx, dw) against the float64 products of the operands, group by group (module docstring)."""
    y, dx, dw = outs
    off = np.concatenate([[0], np.cumsum(sizes)])
    groups = {name: ops[name].split() for name in ("x_fprop", "dy_dgrad", "x_wgrad", "dy_wgrad")}
    for g in range(len(sizes)):
        if sizes[g] == 0:  # an empty group: no rows, dw[g] = 0
            assert not np.any(np.asarray(dw[g], np.float32)), f"{what}: dw group {g}"
            continue
        rows = slice(off[g], off[g + 1])
        for name, got, a, b, dn, k in (("y", y[rows], groups["x_fprop"][g], _expert(ops["w_fprop"], g), FPROP, K),
                                       ("dx", dx[rows], groups["dy_dgrad"][g], _expert(ops["w_dgrad"], g), DGRAD, N),
                                       ("dw", dw[g], groups["x_wgrad"][g], groups["dy_wgrad"][g], WGRAD, sizes[g])):
            ref, bound = operand_bound(a, b, dn, int(k))
            assert_within(got, ref, cast_bound(ref, bound, got.dtype), f"{what}: {name} group {g}")
    assert not np.any(np.asarray(y[off[-1] :], np.float32)) and not np.any(np.asarray(dx[off[-1] :], np.float32))


QUANTIZED = [
    pytest.param(recipes.MXFP8(), id="mxfp8"),
    pytest.param(recipes.NVFP4Fwd_MXFP8Bwd(), id="nvfp4-fwd-mxfp8-bwd"),
    pytest.param(recipes.NVFP4(), id="nvfp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_quantized_recipes_against_float64(recipe):
    x, w, dy, key = _data(1)
    outs = ragged_vjp(x, w, SIZES, dy, key, recipe)
    assert [o.dtype for o in outs] == [jnp.bfloat16] * 3 and outs[2].shape == (G, K, N)
    check_ragged(outs, operands(x, w, SIZES, dy, key, recipe), SIZES, recipe.name)


def test_bf16_recipe_is_lax_ragged_dot():
    x, w, dy, key = _data(2)
    gs = jnp.asarray(SIZES)
    got = ragged_vjp(x, w, gs, dy, key, recipes.BF16())

    @jax.jit
    def want(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs), x, w)
        return (y, *vjp(dy))

    for a, b in zip(got, want(x, w, gs, dy), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_misaligned_traced_group_gives_nan_wgrad_only():
    """Group 2 has 40 rows (not a whole MXFP8 block of tokens): its dw is NaN, the others are finite; fprop and
    dgrad have no alignment constraint (same compiled function as test_quantized_recipes_against_float64)."""
    x, w, dy, key = _data(3)
    sizes = np.array([32, 0, 40, 64], np.int32)
    y, dx, dw = (np.asarray(o, np.float32) for o in ragged_vjp(x, w, sizes, dy, key, recipes.MXFP8()))
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    assert np.isnan(dw[2]).all() and np.isfinite(dw[[0, 1, 3]]).all()


def test_residuals_are_quantized():
    """The VJP keeps float4 / float8 codes of x and w (and the group sizes), never a bfloat16 copy."""
    x, w, _, key = _data(4)
    for recipe in (recipes.NVFP4(), recipes.MXFP8()):
        res = jax.eval_shape(lambda x, w, r=recipe: jax.vjp(
            lambda x, w: jax_fp4.ragged_dot(x, w, jnp.asarray(SIZES), recipe=r, key=key), x, w)[1], x, w)
        leaves = jax.tree.leaves(res)
        big = [a for a in leaves if np.prod(a.shape) >= x.size // 2]
        assert big and all(jnp.dtype(a.dtype).itemsize == 1 for a in big), [(a.shape, a.dtype) for a in big]


SR_FPROP = recipes.Recipe("sr-fprop", jax_fp4.NVFP4(stochastic_rounding=True), jax_fp4.NVFP4())


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((jnp.ones((T, K)), jnp.ones((G, K + 1, N)), SIZES), {}, "expected lhs"),
        ((jnp.ones((T, K)), jnp.ones((G, K, N)), SIZES[:3]), {}, "group_sizes must be int"),
        ((jnp.ones((T, K)), jnp.ones((G, K, N)), SIZES.astype(np.float32)), {}, "group_sizes must be int"),
        ((jnp.ones((T, K)), jnp.ones((G, K, N)), SIZES), {"recipe": recipes.NVFP4_1x64()}, "fprop_x .* cannot"),
        ((jnp.ones((T, K)), jnp.ones((G, K, N)), SIZES), {"recipe": SR_FPROP}, "needs key"),
        ((jnp.ones((T, 48)), jnp.ones((G, 48, N)), SIZES), {"recipe": recipes.MXFP8()}, "not a multiple"),
        ((jnp.ones((T, K)), jnp.ones((G, K, N)), SIZES), {"recipe": "fp4"}, "unknown recipe 'fp4'"),
    ],
)
def test_errors(args, kw, match):
    kw = {"recipe": recipes.MXFP8()} | kw
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: jax_fp4.ragged_dot(*a, **kw), *args)
