"""Grouped GEMMs (`jax_fp4.ragged_dot`) and `MoEMLP` raise `jax_fp4.blocking.BlockingError` for shapes their recipe
cannot block, as `jax_fp4.dense` does: the message names each GEMM operand role, the dimension or the group, the
layer path (MoEMLP) and the fixes, and the policy rule it proposes keeps the layer unquantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp4
from jax_fp4 import policy, recipes
from jax_fp4.blocking import BlockingError
from jax_fp4.flax import policy as flax_policy
from jax_fp4.flax.moe import MoEMLP


def _ragged(x, w, sizes, recipe, grad):
    f = lambda x: jax_fp4.ragged_dot(x, w, sizes, recipe=recipe).astype(jnp.float32).sum()  # noqa: E731
    return jax.grad(f)(x) if grad else f(x)


def test_forward_only_names_the_fprop_roles_and_the_fix():
    with pytest.raises(BlockingError) as e:
        _ragged(jnp.ones((64, 48)), jnp.ones((2, 48, 32)), jnp.array([32, 32]), recipes.MXFP8(), grad=False)
    msg = str(e.value)
    for part in ("jax_fp4.ragged_dot", "forward only", "fprop x [T, K=48]", "fprop w [K=48, N=32]",
                 "pad K to a multiple of 32", "nvfp4", "jax_fp4.policy.exclude("):
        assert part in msg, (part, msg)
    assert "nvfp4-1x64" not in msg  # not a grouped recipe
    assert e.value.details["K"] == 48


def test_differentiated_names_the_dgrad_roles():
    with pytest.raises(BlockingError) as e:
        _ragged(jnp.ones((64, 64)), jnp.ones((2, 64, 48)), jnp.array([32, 32]), recipes.MXFP8(), grad=True)
    msg = str(e.value)
    assert "dgrad dy [T, N=48]" in msg and "dgrad w [K=64, N=48]" in msg and "fprop x [" not in msg


def test_concrete_misaligned_groups_name_the_wgrad_roles_and_the_groups():
    with pytest.raises(BlockingError) as e:
        _ragged(jnp.ones((64, 64)), jnp.ones((2, 64, 64)), np.array([30, 34]), recipes.MXFP8(), grad=True)
    msg = str(e.value)
    for part in ("wgrad x", "wgrad dy", "group 0 has 30 rows", "group 1 has 34 rows", "not a multiple of 32",
                 "pad every group to a multiple of 32 rows", "group_alignment"):
        assert part in msg, (part, msg)
    # forward only, the same sizes need no alignment
    _ragged(jnp.ones((64, 64)), jnp.ones((2, 64, 64)), np.array([30, 34]), recipes.MXFP8(), grad=False)


class _Block(nnx.Module):
    def __init__(self, recipe):
        self.moe = MoEMLP(64, 48, 4, recipe=recipe, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.moe(x)


def test_moe_names_its_layer_path_and_projection_and_the_rule_fixes_it():
    model = _Block(recipes.MXFP8())
    x = jnp.ones((8, 64))
    with pytest.raises(BlockingError) as e:
        model(x)
    msg = str(e.value)
    for part in ("MoEMLP, down projection", "of layer 'moe'", "fprop x [T, K=48]", "jax_fp4.policy.exclude('moe')"):
        assert part in msg, (part, msg)
    flax_policy.apply(policy.exclude("moe"), model)  # the fix the message proposes
    assert model(x).shape == (8, 64)


def test_blocking_error_is_a_value_error():
    assert issubclass(BlockingError, ValueError)
