"""`jax_fp4.dense` decides its GEMMs' routes once per call (`jax_fp4.route.recipe_routes`), forward and backward."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_fp4
from jax_fp4 import recipes


def test_routes_are_computed_once_per_differentiated_call(monkeypatch):
    module = sys.modules["jax_fp4.dense"]
    calls = []
    real = module.recipe_routes
    monkeypatch.setattr(module, "recipe_routes", lambda *a: calls.append(a) or real(*a))
    x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
    jax.grad(lambda x, w: jnp.sum(jax_fp4.dense(x, w, recipe=recipes.MXFP8())), (0, 1))(x, w)
    assert len(calls) == 1
    jax_fp4.dense(x, w, recipe=recipes.NVFP4_1x64())
    assert len(calls) == 2
