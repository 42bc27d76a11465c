"""CPU benchmark: the Dense training step and quantize throughput on the host, with the CPU FFI handlers (cpp/cpu/)
when the CPU extension is built, else the jnp reference (run it once under each to compare: the installed package
against a source checkout imported with PYTHONPATH=<checkout>).

Dense step: `jit(value_and_grad(loss, argnums=(0, 1, 2)))(x, w, b)` with loss = sum(dense(x, w, b).astype(f32) * g),
x bf16 [M, K], w bf16 [K, N], for the nvfp4-fwd-mxfp8-bwd recipe and for bf16 (plain dot_general): compile time
(lower + compile) and the best-of-`repeats` mean step time over `iters` calls, and their ratios to bf16.
Quantize: `quantize_rowwise_columnwise(x, NVFP4(), MXFP8())` (the recipe's forward pass of x) and MXFP8 rowwise +
columnwise of bf16 x [M, K]: GB/s of input read, and per core (divided by os.cpu_count(), the handler's threads).

Timings on a shared machine vary with its load; the table says how many cores the process saw.

Usage: python benchmarks/cpu.py [--iters 10] [--repeats 3] [--out benchmarks/results/cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import MXFP8, NVFP4, dense, recipes
from jax_fp4._src import ffi
from jax_fp4.quantize import quantize_rowwise_columnwise

DENSE_SHAPES = {"512x256->512": (512, 256, 512), "2048x1024->1024": (2048, 1024, 1024)}  # (M tokens, K, N)
QUANT_SHAPES = {"2048x2048": (2048, 2048), "4096x4096": (4096, 4096)}
RECIPES = ("bf16", "nvfp4-fwd-mxfp8-bwd")


def _best_mean(fn, args, iters, repeats):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def dense_step(recipe_name, M, K, N, iters, repeats):
    r = recipes.by_name(recipe_name)
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(k[1], (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    b = jnp.zeros((N,), jnp.bfloat16)
    g = jax.random.normal(k[2], (M, N), jnp.bfloat16)
    key = k[3]

    def loss(x, w, b, g, key):  # g and key are arguments, not constants XLA would fold at compile time
        y = dense(x, w, b, recipe=r, key=key if r.needs_key else None)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t = time.perf_counter()
    compiled = step.lower(x, w, b, g, key).compile()
    compile_s = time.perf_counter() - t
    return compile_s, _best_mean(compiled, (x, w, b, g, key), iters, repeats)


def quantize_gbps(M, K, pair, iters, repeats):
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
    fn = jax.jit(lambda x: quantize_rowwise_columnwise(x, *pair))
    s = _best_mean(fn, (x,), iters, repeats)
    return x.nbytes / s / 1e9, s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    res = {"jax": jax.__version__, "cpu_kernels": ffi.HAS_CPU_KERNELS, "cores": cores, "dense": [], "quantize": []}
    print(f"jax {jax.__version__}  CPU kernels: {ffi.HAS_CPU_KERNELS}  cores: {cores}")
    print(f"{'dense step':28s} {'recipe':22s} {'compile s':>10s} {'step ms':>9s} {'compile/bf16':>13s} "
          f"{'step/bf16':>10s}")
    for name, (M, K, N) in DENSE_SHAPES.items():
        base = None
        for rn in RECIPES:
            c, s = dense_step(rn, M, K, N, a.iters, a.repeats)
            base = base or (c, s)
            res["dense"].append(dict(shape=name, recipe=rn, compile_s=c, step_s=s))
            print(f"{name:28s} {rn:22s} {c:10.2f} {s * 1e3:9.2f} {c / base[0]:13.2f} {s / base[1]:10.2f}")
    print(f"\n{'quantize (bf16 input)':28s} {'formats':22s} {'ms':>10s} {'GB/s':>9s} {'GB/s/core':>13s}")
    for name, (M, K) in QUANT_SHAPES.items():
        for label, pair in (("nvfp4 row + mxfp8 col", (NVFP4(), MXFP8())), ("mxfp8 row + col", (MXFP8(), MXFP8()))):
            gbps, s = quantize_gbps(M, K, pair, a.iters, a.repeats)
            res["quantize"].append(dict(shape=name, formats=label, s=s, gbps=gbps, gbps_per_core=gbps / cores))
            print(f"{name:28s} {label:22s} {s * 1e3:10.2f} {gbps:9.2f} {gbps / cores:13.3f}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
