"""LayerNormMLP training step with the tensor amax from the producer (GPU): the layer as it runs (each Dense running
its own amax and NaN passes over its input) against the same submodules composed with the norm's and the
activation's output amax, ``jnp.max(jnp.abs(y))`` fused by XLA into the producing op, handed to up / down as
``x_amax``; and bf16.

Step: `jit(grad(sum(layer(x).astype(f32) * g)))` over the layer's parameters and x (NNX, GELU, LayerNorm), tokens
M = 32768 by default. Per shape (d_model -> hidden) and recipe: ms per step of the layer and of the composition with
the producer amax, the time the producer amax saves (negative: it costs), and the count of `jf4_amax` custom calls
in each compiled step (the passes it removes).
The outputs of both steps are checked bit for bit.

Usage: python benchmarks/layer_amax.py [--shapes 768x3072,2048x8192] [--tokens 32768]
                                       [--recipes nvfp4-fwd-mxfp8-bwd,nvfp4] [--iters 20] [--repeats 3]
                                       [--out benchmarks/results/layer_amax.json]
"""

from __future__ import annotations

import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp4 import recipes
from jax_fp4.flax import nnx as fx
from jax_fp4.flax.nnx_layers import split_rngs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402


def _layer(m, x, key):
    return m(x, rngs=key)


def _producer(m, x, key):
    """The layer's submodules with the norm's and the activation's amax handed over, with the stochastic-rounding keys
    the layer gives them."""
    k_up, k_down = split_rngs(key, 2)
    y = m.norm(x)
    h = jax.nn.gelu(m.up(y, rngs=k_up, x_amax=jnp.max(jnp.abs(y))))
    return m.down(h, rngs=k_down, x_amax=jnp.max(jnp.abs(h)))


def _step(layer, fn):
    """jit(grad) of sum(fn(layer, x) * g) over the layer's parameters and x, a pure function of (params, x, g)."""
    gdef, params, rest = nnx.split(layer, nnx.Param, ...)  # rest: the stochastic-rounding stream of SR recipes

    key = jax.random.key(1) if layer.up.recipe.needs_key else None

    def loss(p, x, g):
        return jnp.sum(fn(nnx.merge(gdef, p, rest), x, key).astype(jnp.float32) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def main():
    ap = bench.base_parser(__doc__, "layer_amax", iters=20, repeats=3)
    ap.add_argument("--shapes", default="768x3072,2048x8192", help="d_model x hidden, comma-separated")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--recipes", default="bf16,nvfp4-fwd-mxfp8-bwd,nvfp4")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = bench.setup_device("'jf4_quantize'")
    results = {**bench.run_info(dev), "method": "jit(grad) of a LayerNormMLP step, best of --repeats"}
    print(bench.describe_run(results), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        d, h = (int(v) for v in shape.split("x"))
        kx, kg = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (args.tokens, d), jnp.bfloat16)
        g = jax.random.normal(kg, (args.tokens, d), jnp.bfloat16)
        for name in args.recipes.split(","):
            layer = fx.LayerNormMLP(d, h, recipe=recipes.by_name(name), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            row = {"shape": shape, "tokens": args.tokens, "recipe": name}
            outs = {}
            for variant, fn in (("layer", _layer), ("producer", _producer)):
                step, state = _step(layer, fn)
                text = step.lower(state, x, g).compile().as_text()
                row[f"{variant}_amax_calls"] = len(re.findall(r'custom_call_target="jf4_amax"', text))
                t, outs[variant] = bench.time_calls(step, [(state, x, g)], args.iters, args.repeats, keep=True)
                row[f"{variant}_ms"] = t * 1e3
            row["saved_us"] = (row["layer_ms"] - row["producer_ms"]) * 1e3
            row["bit_exact"] = all(bench.bits_equal(a, b) for a, b in
                                   zip(jax.tree.leaves(outs["layer"]), jax.tree.leaves(outs["producer"]), strict=True))
            rows.append(row)
            print(row, flush=True)
    results["rows"] = rows
    bench.print_table(
        [("shape", "<10"), ("recipe", "<20"), ("layer ms", ">9"), ("producer ms", ">12"), ("saved µs", ">9"),
         ("jf4_amax calls", ">15"), ("bits", "<6")],
        [[r["shape"], r["recipe"], f"{r['layer_ms']:.3f}", f"{r['producer_ms']:.3f}", f"{r['saved_us']:.0f}",
          f"{r['layer_amax_calls']} vs {r['producer_amax_calls']}", "same" if r["bit_exact"] else "DIFFER"]
         for r in rows])
    bench.finish_run(results, args.out, t_start)


if __name__ == "__main__":
    main()
