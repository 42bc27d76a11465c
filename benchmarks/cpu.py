"""CPU benchmark: the Dense training step and quantize throughput on the host, with the CPU FFI handlers (cpp/cpu/)
when the CPU extension is built, else the jnp reference (run it once under each to compare: the installed package
against a source checkout imported with PYTHONPATH=<checkout>).

Dense step: `jit(value_and_grad(loss, argnums=(0, 1, 2)))(x, w, b)` with loss = sum(dense(x, w, b).astype(f32) * g),
x bf16 [M, K], w bf16 [K, N], for the nvfp4-fwd-mxfp8-bwd recipe and for bf16 (plain dot_general): compile time
(lower + compile) and the best-of-`repeats` mean step time over `iters` calls (wall, and the process's CPU time: all
its threads), and their ratios to bf16. The recipes of one shape are timed in alternation (one repeat of each in
turn), so a change in the machine's load during the run reaches both sides of a ratio alike.
Quantize: `quantize_rowwise_columnwise(x, NVFP4(), MXFP8())` (the recipe's forward pass of x) and MXFP8 rowwise +
columnwise of bf16 x [M, K]: GB/s of input read, and per core (divided by os.cpu_count(), the handler's threads).
Grouped quantize: `grouped_quantize_rowwise_columnwise(x, group_sizes, ...)` of bf16 x [T, K] split into 8 groups
of uneven token counts (multiples of 32, one empty; sizes traced, as a router's output), NVFP4 rowwise + MXFP8
columnwise (the MoE recipe's pairing) and NVFP4 rowwise alone: GB/s of input read, and per core.

Timings on a shared machine vary with its load; the output gives how many cores the process saw and the load average
(os.getloadavg) before and after the run.

Usage: python benchmarks/cpu.py [--iters 10] [--repeats 3] [--parts dense,quantize,grouped]
                                [--out benchmarks/results/cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import MXFP8, NVFP4, dense, grouped_quantize_rowwise_columnwise, recipes
from jax_fp4._src import ffi
from jax_fp4.quantize import quantize_rowwise_columnwise

DENSE_SHAPES = {"512x256->512": (512, 256, 512), "2048x1024->1024": (2048, 1024, 1024)}  # (M tokens, K, N)
QUANT_SHAPES = {"2048x2048": (2048, 2048), "4096x4096": (4096, 4096)}
RECIPES = ("bf16", "nvfp4-fwd-mxfp8-bwd")
GROUPED_SHAPES = {"4096x2048, 8 groups": (4096, 2048, 8)}  # (T tokens, K, N groups)


def _mean(fn, args, iters):
    return _means(fn, args, iters)[0]


def _means(fn, args, iters):
    """(wall seconds, process CPU seconds) per call, averaged over `iters` calls."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters, (time.process_time() - c) / iters


def _best_mean(fn, args, iters, repeats):
    jax.block_until_ready(fn(*args))
    return min(_mean(fn, args, iters) for _ in range(repeats))


def dense_step(recipe_name, M, K, N):
    """(compile seconds, compiled step, its arguments) of the Dense fwd+bwd step for one recipe and shape."""
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
    args = (x, w, b, g, key)
    jax.block_until_ready(compiled(*args))
    return compile_s, compiled, args


def dense_steps(M, K, N, iters, repeats):
    """{recipe: (compile seconds, best-of-`repeats` mean step seconds, its process CPU seconds)}, the recipes' repeats
    alternating. CPU seconds (all the process's threads) change less with other jobs' load than wall time does."""
    built = {rn: dense_step(rn, M, K, N) for rn in RECIPES}
    best = dict.fromkeys(RECIPES, (float("inf"), float("inf")))
    for _ in range(repeats):
        for rn, (_, fn, args) in built.items():
            best[rn] = min(best[rn], _means(fn, args, iters))
    return {rn: (built[rn][0], *best[rn]) for rn in RECIPES}


def quantize_gbps(M, K, pair, iters, repeats):
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
    fn = jax.jit(lambda x: quantize_rowwise_columnwise(x, *pair))
    s = _best_mean(fn, (x,), iters, repeats)
    return x.nbytes / s / 1e9, s


def grouped_sizes(T, n):
    """int32[n] uneven token counts, multiples of 32 summing to T, group 1 empty."""
    w = np.random.default_rng(0).uniform(0.5, 1.5, n)
    w[1] = 0
    sizes = (w / w.sum() * T // 32).astype(np.int32) * 32
    sizes[0] += T - sizes.sum()
    return jnp.asarray(sizes)


def grouped_gbps(T, K, n, pair, iters, repeats):
    x = jax.random.normal(jax.random.key(2), (T, K), jnp.bfloat16)
    fn = jax.jit(lambda x, sizes: grouped_quantize_rowwise_columnwise(x, sizes, *pair)[:2])
    s = _best_mean(fn, (x, grouped_sizes(T, n)), iters, repeats)
    return x.nbytes / s / 1e9, s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="dense,quantize,grouped", help="comma-separated: dense, quantize, grouped")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    cores = os.cpu_count() or 1
    load0 = os.getloadavg()
    res = {"jax": jax.__version__, "cpu_kernels": ffi.HAS_CPU_KERNELS, "cores": cores, "dense": [], "quantize": [],
           "grouped": [], "loadavg_start": load0}
    print(f"jax {jax.__version__}  CPU kernels: {ffi.HAS_CPU_KERNELS}  cores: {cores}  "
          f"load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}")
    if "dense" in parts:
        bench_dense(a, res)
    if "quantize" in parts:
        bench_quantize(a, res, cores)
    if "grouped" in parts:
        bench_grouped(a, res, cores)
    load1 = os.getloadavg()
    res["loadavg_end"] = load1
    print(f"load average at the end {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def bench_dense(a, res):
    print(f"{'dense step':28s} {'recipe':22s} {'compile s':>10s} {'step ms':>9s} {'compile/bf16':>13s} "
          f"{'step/bf16':>10s} {'cpu ms':>9s} {'cpu/bf16':>9s}")
    for name, (M, K, N) in DENSE_SHAPES.items():
        steps = dense_steps(M, K, N, a.iters, a.repeats)
        base = steps["bf16"]
        for rn, (c, s, cpu) in steps.items():
            res["dense"].append(dict(shape=name, recipe=rn, compile_s=c, step_s=s, step_cpu_s=cpu))
            print(f"{name:28s} {rn:22s} {c:10.2f} {s * 1e3:9.2f} {c / base[0]:13.2f} {s / base[1]:10.2f} "
                  f"{cpu * 1e3:9.2f} {cpu / base[2]:9.2f}")


def bench_quantize(a, res, cores):
    print(f"\n{'quantize (bf16 input)':28s} {'formats':22s} {'ms':>10s} {'GB/s':>9s} {'GB/s/core':>13s}")
    for name, (M, K) in QUANT_SHAPES.items():
        for label, pair in (("nvfp4 row + mxfp8 col", (NVFP4(), MXFP8())), ("mxfp8 row + col", (MXFP8(), MXFP8()))):
            gbps, s = quantize_gbps(M, K, pair, a.iters, a.repeats)
            res["quantize"].append(dict(shape=name, formats=label, s=s, gbps=gbps, gbps_per_core=gbps / cores))
            print(f"{name:28s} {label:22s} {s * 1e3:10.2f} {gbps:9.2f} {gbps / cores:13.3f}")


def bench_grouped(a, res, cores):
    print(f"\n{'grouped quantize (bf16)':28s} {'formats':22s} {'ms':>10s} {'GB/s':>9s} {'GB/s/core':>13s}")
    for name, (T, K, n) in GROUPED_SHAPES.items():
        for label, pair in (("nvfp4 row + mxfp8 col", (NVFP4(), MXFP8())), ("nvfp4 row", (NVFP4(), None))):
            gbps, s = grouped_gbps(T, K, n, pair, a.iters, a.repeats)
            res["grouped"].append(dict(shape=name, formats=label, s=s, gbps=gbps, gbps_per_core=gbps / cores))
            print(f"{name:28s} {label:22s} {s * 1e3:10.2f} {gbps:9.2f} {gbps / cores:13.3f}")


if __name__ == "__main__":
    main()
