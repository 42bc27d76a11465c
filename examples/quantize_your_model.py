"""Quantize your own Flax NNX model with jax_fp4: a policy, the drop-in dot_general, a few training steps, and the
quantization statistics of every quantized layer.

The model below is plain Flax (nnx.Linear layers); nothing in it knows about jax_fp4. `flax_policy.apply(...,
drop_in=True)` gives its layers a quantized `dot_general` as the policy says: NVFP4 forward / MXFP8 backward GEMMs for
the hidden layers, the output layer kept in bf16. Runs on the CPU in seconds.

Run: python examples/quantize_your_model.py [--steps 20]
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_fp4 import diagnostics, policy, recipes
from jax_fp4.flax import policy as flax_policy


class MLP(nnx.Module):
    """Your model: any NNX module whose layers take a `dot_general` (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)."""

    def __init__(self, sizes, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.gelu(layer(x))
        return self.layers[-1](x)


def make_policy(num_layers: int) -> policy.Policy:
    """The output layer in bf16 (first matching rule wins), every other layer NVFP4 forward / MXFP8 backward."""
    return policy.exclude(f"layers/{num_layers - 1}") + policy.uniform(recipes.NVFP4Fwd_MXFP8Bwd())


def batch(key, n: int, d: int):
    """A regression task: y = sin(x @ a) with a fixed random a."""
    x = jax.random.normal(key, (n, d), jnp.float32)
    a = jax.random.normal(jax.random.key(42), (d, d), jnp.float32) / jnp.sqrt(d)
    return x, jnp.sin(x @ a)


def stats_table(model, assignments, x) -> str:
    """The forward operands' statistics (`jax_fp4.diagnostics.STATS`) of each quantized layer on the batch x."""
    lines = [f"{'layer':10s} {'recipe':22s} {'operand':8s} " + " ".join(f"{s:>15s}" for s in diagnostics.STATS)]
    for i, layer in enumerate(model.layers):  # walk the model's forward pass, layer by layer
        recipe = assignments[f"layers/{i}"]
        if recipe is not None and recipe.quantized:
            s = diagnostics.dense_stats(x, layer.kernel[...], recipe=recipe)
            for op in ("fprop_x", "fprop_w"):
                vals = " ".join(f"{float(v):15.4g}" for v in s[diagnostics.OPERANDS.index(op)])
                lines.append(f"layers/{i:<3d} {recipe.name:22s} {op:8s} {vals}")
        x = layer(x) if i == len(model.layers) - 1 else nnx.gelu(layer(x))
    return "\n".join(lines)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def main(steps: int = 20, sizes=(64, 128, 128, 64), batch_size: int = 64):
    model = MLP(sizes, rngs=nnx.Rngs(0))
    pol = make_policy(len(sizes) - 1)
    print(flax_policy.describe(pol, model, drop_in=True))  # layer -> recipe, and the rule that decided it
    assignments = flax_policy.apply(pol, model, drop_in=True)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    x_eval, y_eval = batch(jax.random.key(10_000), batch_size, sizes[0])  # held out
    before = float(nnx.jit(loss_fn)(model, x_eval, y_eval))
    for step in range(steps):
        train_step(model, optimizer, *batch(jax.random.key(step), batch_size, sizes[0]))
    after = float(nnx.jit(loss_fn)(model, x_eval, y_eval))
    print(f"held-out loss: {before:.4f} -> {after:.4f} after {steps} steps")
    print(stats_table(model, assignments, x_eval))
    return before, after


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    main(ap.parse_args().steps)
