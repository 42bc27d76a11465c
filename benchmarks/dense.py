"""Dense-layer training step benchmark (GPU): fwd + dgrad + wgrad + dbias of `jax_fp4.dense` for every recipe,
against the bfloat16 step and against `jax.nn.scaled_dot_general` (mxfp8 / nvfp4 configs).

The step is `jit(value_and_grad(loss, argnums=(0, 1, 2)))(x, w, b)` with loss = sum(dense(x, w, b).astype(f32) * g)
for a fixed random bfloat16 cotangent g, i.e. one forward GEMM, dgrad, wgrad and the bias gradient (6*M*K*N flops);
--no-bias drops the bias (b = None) and its gradient.
Per recipe and shape it reports ms per step, the ratio to the bf16 step of the same shape, the residual bytes (what
the layer's VJP keeps from forward to backward: every array leaf of the pullback, float4 at 4 bits, PRNG keys at
their key-data size) and their ratio to bf16, and the effective TFLOP/s (6*M*K*N / step time). The compiled step's
memory_analysis (temp / argument / output bytes) and compile time go to the JSON only.

jax.nn rows: the same step with y = jax.nn.scaled_dot_general(x, w, ..., configs=[lhs, rhs, grad]) + b; the NVFP4
global scales are amax / (6 * 448) of x and w, computed in the step (stop_gradient). jax.nn keeps bf16 x and w as
residuals, and its nvfp4 backward runs bf16 GEMMs. It needs cuDNN's block-scaled matmul (sm_100+); "n/a" elsewhere.
On compute capability 9.x (H100/H200) with the `jf4_gemm` kernel, jax_fp4's GEMMs run on it ("kernel" route,
packed operands); elsewhere without a native block-scaled GEMM they are emulated (exact block-scaled values in a
bf16 x bf16 dot). `--implementations auto,emulated,kernel` times each recipe on each route of `jax_fp4.dense`
(rows "recipe [route]"; `jax_fp4.route.recipe_routes` gives the route of each GEMM, printed per row).

Timing: one jitted step, compiled once (lower().compile()), called alternately on NBUF rotated (x, w, b, g) buffer
sets (fewer when they would not fit in MEM_CAP_BYTES); 2 warm-up calls, then `iters` calls (fewer for slow steps,
about REPEAT_BUDGET_S per repeat) enqueued back to back, wall time until `jax.block_until_ready` / calls. Best of
`repeats`.

Usage: python benchmarks/dense.py [--shapes default|small|4096->4096,...] [--recipes name,...] [--iters 10]
                                  [--implementations auto[,emulated,kernel]] [--repeats 3]
                                  [--out benchmarks/results/dense.json]
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

from jax_fp4 import dense, recipes
from jax_fp4._src import ffi
from jax_fp4.dense import IMPLEMENTATIONS, gemm_routes
from jax_fp4.gemm import kernel_gemm_available, native_gemm_available

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402
import traffic  # noqa: E402

SHAPES = {"4096->4096": (16384, 4096, 4096), "4096->14336": (16384, 4096, 14336)}  # name: (M tokens, K, N)
#: further shapes --shapes can name: the MLP projections at d_model 768 (32768 tokens) and 2048 (16384 tokens)
EXTRA_SHAPES = {"768->3072": (32768, 768, 3072), "3072->768": (32768, 3072, 768), "2048->8192": (16384, 2048, 8192),
                "8192->2048": (16384, 8192, 2048)}
SMALL_SHAPES = {"small 512->512": (1024, 512, 512)}
NBUF = 2  # rotated input buffer sets
MEM_CAP_BYTES = 6 << 30  # cap on the rotated input sets (the step's outputs and temporaries come on top)
REPEAT_BUDGET_S = 2.0
DN = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]
TARGET_RECIPE, TARGET_STEP, TARGET_RESIDUAL = "nvfp4-fwd-mxfp8-bwd", 1.25, 0.6
TARGET_FLOOR = 1.2  # each quantized step <= 1.2 x (the bf16 step + its traffic floor at copy bandwidth)
#: step-ratio targets of the jf4_gemm route (rows whose three GEMMs run on the kernel)
KERNEL_TARGETS = {"nvfp4-fwd-mxfp8-bwd": 1.05, "nvfp4-1x64": 1.15}
JNN = {"jax.nn mxfp8": "mxfp8", "jax.nn nvfp4": "nvfp4"}


def all_layers(implementations=("auto",)) -> dict:
    """name -> (x, w, b, key) -> y bf16 [M, N]; bf16 first (the baseline). With several implementations, each
    quantized recipe runs once per route of `jax_fp4.dense`, named "recipe [implementation]"."""
    rs = {name: recipes.by_name(name) for name in recipes.RECIPES}
    rs["mxfp8-hybrid"] = recipes.MXFP8("e5m2")
    layers = {"bf16": _fp4_layer(rs.pop("bf16"))}
    for name, r in rs.items():
        for impl in implementations:
            layers[name if len(implementations) == 1 else f"{name} [{impl}]"] = _fp4_layer(r, impl)
    layers.update({name: _jnn_layer(mode) for name, mode in JNN.items()})
    return layers


def _fp4_layer(r, implementation="auto"):
    def layer(x, w, b, key):
        return dense(x, w, b, recipe=r, key=key if r.needs_key else None, implementation=implementation)

    layer.routes = lambda: gemm_routes(r, implementation)
    layer.recipe = r
    return layer


def _jnn_layer(mode):
    def layer(x, w, b, key):
        del key
        if mode == "mxfp8":
            cfgs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
        else:  # global scale = tensor amax / (6 * 448), as a non-differentiated per-step value
            gs = [jax.lax.stop_gradient(jnp.max(jnp.abs(a)).astype(jnp.float32).reshape(1) / (6.0 * 448.0))
                  for a in (x, w)]
            gs.append(jnp.ones((1,), jnp.float32))
            cfgs = [jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=s) for s in gs]
        y = jax.nn.scaled_dot_general(x, w, DN, preferred_element_type=jnp.bfloat16, configs=cfgs)
        return y if b is None else y + b.astype(y.dtype)

    return layer


def make_step(layer):
    def loss(x, w, b, g, key):
        return jnp.sum(layer(x, w, b, key).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


# ---- accounting -------------------------------------------------------------------------------------------------
def residual_bytes(layer, args) -> int:
    """Bytes of the array leaves of the layer's pullback (jax.vjp(layer, x, w, b)[1]), by abstract evaluation.

    The pullback is traced (not jitted and returned): jax_fp4's custom VJP keeps static ShapeDtypeStruct residuals,
    which a jitted function cannot return and which eval_shape would count as arrays. Tracers are the real residuals.
    """
    x, w, b, _, key = args

    def res(x, w, b, key):
        pullback = jax.vjp(lambda x, w, b: layer(x, w, b, key), x, w, b)[1]
        return [leaf for leaf in jax.tree.leaves(pullback) if isinstance(leaf, jax.Array)]

    return bench.tree_bytes(jax.eval_shape(res, x, w, b, key))


def memory_stats(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if m is None:
        return None
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "peak_memory_in_bytes")
    return {k: int(getattr(m, k)) for k in keys if getattr(m, k, None) is not None}


def make_argsets(m, k, n, nbuf):
    """nbuf sets of (x [m, k], w [k, n], b [n], g [m, n], key), bf16, unit-variance-ish activations."""
    sets = []
    for i in range(nbuf):
        kx, kw, kb, kg = jax.random.split(jax.random.key(100 + i), 4)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
        b = (0.1 * jax.random.normal(kb, (n,), jnp.float32)).astype(jnp.bfloat16)
        g = jax.random.normal(kg, (m, n), jnp.float32).astype(jnp.bfloat16)
        sets.append(jax.block_until_ready((x, w, b, g, jax.random.key(i))))
    return sets


# ---- CLI --------------------------------------------------------------------------------------------------------
def parse_recipes(spec: str | None, layers: dict) -> dict:
    if not spec:
        return layers
    names = [s.strip() for s in spec.split(",") if s.strip()]
    base = {name.split(" [")[0] for name in layers}
    bad = [s for s in names if s not in base]
    if bad:
        raise SystemExit(f"unknown recipe(s) {bad}; known: {', '.join(sorted(base))}")
    return {name: fn for name, fn in layers.items()
            if name == "bf16" or name.split(" [")[0] in names}  # bf16: the baseline


_f = functools.partial(bench.fmt, missing="n/a")


def main():
    ap = bench.base_parser(__doc__, "dense", iters=10, repeats=3,
                     shapes_help="default | small (x [1024, 512], w [512, 512]) | comma list of "
                     + ", ".join({**SHAPES, **EXTRA_SHAPES}))
    ap.add_argument("--recipes", default=None, help="comma list of recipe names (bf16 always runs: the baseline)")
    ap.add_argument("--implementations", default="auto",
                    help=f"comma list of jax_fp4.dense implementations to compare ({', '.join(IMPLEMENTATIONS)})")
    ap.add_argument("--no-bias", action="store_true",
                    help="layers without a bias (on CUDA a bias-free NVFP4 fprop keeps its dot apart from the "
                         "tensor-scale epilogue, docs/performance.md, \"GEMM lowering\"; default: with a bias)")
    args = ap.parse_args()
    shapes = bench.parse_shapes(args.shapes, SHAPES if args.shapes == "default" else {**SHAPES, **EXTRA_SHAPES},
                                SMALL_SHAPES, dims=None)
    impls = tuple(s.strip() for s in args.implementations.split(",") if s.strip())
    if not impls or any(i not in IMPLEMENTATIONS for i in impls):
        raise SystemExit(f"--implementations: choose from {', '.join(IMPLEMENTATIONS)}, got {args.implementations!r}")
    layers = parse_recipes(args.recipes, all_layers(impls))

    dev = bench.setup_device("quantization")
    native = native_gemm_available()
    results = {
        **bench.run_info(dev), "native_gemm": native, "kernel_gemm": kernel_gemm_available(),
        "implementations": list(impls), "bias": not args.no_bias,
        "method": (f"one compiled step over <= {NBUF} rotated input sets, 2 warm-up calls, best of {args.repeats} x "
                   f"<= {args.iters} calls, block_until_ready"),
        "targets": {"recipe": TARGET_RECIPE, "step_ratio_max": TARGET_STEP, "residual_ratio_max": TARGET_RESIDUAL,
                    "floor_ratio_max": TARGET_FLOOR,
                    "kernel_step_ratio_max": KERNEL_TARGETS},
        "copy_GBps": {}, "rows": [],
    }
    print(f"device: {results['device']}  jax {results['jax']}  CUDA kernels: {ffi.HAS_CUDA_KERNELS}  native "
          f"block-scaled GEMM: {native}  jf4_gemm kernel: {results['kernel_gemm']}\n({results['method']})", flush=True)
    rows, t_start = results["rows"], time.perf_counter()
    for sname, (m, k, n) in shapes.items():
        set_bytes = 2 * (m * k + k * n + m * n + n)
        nbuf = max(1, min(NBUF, MEM_CAP_BYTES // set_bytes))
        argsets = make_argsets(m, k, n, nbuf)
        if args.no_bias:
            argsets = [(x, w, None, g, key) for x, w, _, g, key in argsets]
        _, results["copy_GBps"][sname] = bench.copy_bandwidth([a[3] for a in argsets], args.iters, args.repeats)
        print(f"[{sname}] x [{m}, {k}] w [{k}, {n}], {nbuf} buffer set(s); copy bandwidth of g "
              f"{results['copy_GBps'][sname] / 1e3:.2f} TB/s", flush=True)
        flops = 6 * m * k * n
        base = {}
        for name, layer in layers.items():
            row = {"recipe": name, "shape_name": sname, "shape": {"M": m, "K": k, "N": n}, "n_buffers": nbuf,
                   "ms": None, "step_ratio": None, "residual_bytes": None, "residual_ratio": None, "TFLOPs": None}
            try:
                if hasattr(layer, "routes"):
                    row["routes"] = layer.routes()
                row["residual_bytes"] = residual_bytes(layer, argsets[0])
                t0 = time.perf_counter()
                lowered = make_step(layer).lower(*argsets[0])
                row["uses_jf4_kernels"] = "jf4_" in lowered.as_text()
                compiled = lowered.compile()
                row["compile_s"] = time.perf_counter() - t0
                row["memory_analysis"] = memory_stats(compiled)
                t, _ = bench.time_calls(compiled, argsets, args.iters, args.repeats, warmup=2, budget_s=REPEAT_BUDGET_S)
                del compiled, lowered
                row["ms"], row["TFLOPs"] = t * 1e3, flops / t / 1e12
            except Exception as e:  # e.g. jax.nn scaled_dot_general without cuDNN block-scaled GEMM: n/a
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  note: {name} [{sname}]: {row['error']}", flush=True)
            if name == "bf16":
                base = {"ms": row["ms"], "residual_bytes": row["residual_bytes"]}
            if row["ms"] is not None and base.get("ms"):
                row["step_ratio"] = row["ms"] / base["ms"]
            if getattr(layer, "recipe", None) is not None and layer.recipe.quantized:
                fb = traffic.floor_bytes(layer.recipe, m, k, n)
                row["floor_bytes"] = fb
                row["floor_ms"] = fb["total"] / (results["copy_GBps"][sname] * 1e9) * 1e3
                if row["ms"] is not None and base.get("ms"):
                    row["floor_ratio"] = row["ms"] / (base["ms"] + row["floor_ms"])
            if row["residual_bytes"] is not None and base.get("residual_bytes"):
                row["residual_ratio"] = row["residual_bytes"] / base["residual_bytes"]
            rows.append(row)
            routes = "/".join(row["routes"].values()) if row.get("routes") else ""
            print(f"  {name:<34} {_f(row['ms'], '9.3f'):>9} ms  residuals {_f(row['residual_bytes'], ',')} B  "
                  f"compile {_f(row.get('compile_s'), '.1f')} s  {routes} (t={time.perf_counter() - t_start:.0f}s)",
                  flush=True)
        del argsets

    print(f"\n{bench.describe_run(results)}  native block-scaled GEMM: {native}")
    step = "fwd + dgrad + wgrad" + ("" if args.no_bias else " + dbias")
    print(f"step = {step}; ratios are to the bf16 row of the same shape; residuals = array "
          "leaves of the layer's VJP (float4 at 4 bits); TFLOP/s = 6*M*K*N / step")
    bench.print_table(
        [("recipe", "<34"), ("shape", "<16"), ("step ms", ">9"), ("vs bf16", ">8"), ("floor ms", ">9"),
         ("vs bf16+floor", ">13"), ("residual MB", ">12"), ("vs bf16", ">8"), ("TFLOP/s", ">8"),
         ("fprop/dgrad/wgrad route", "<26")],
        [(r["recipe"], r["shape_name"], _f(r["ms"], "9.3f"), _f(r["step_ratio"], "7.3f"), _f(r.get("floor_ms"), "9.3f"),
          _f(r.get("floor_ratio"), "13.3f"),
          _f(None if r["residual_bytes"] is None else r["residual_bytes"] / 2**20, "12.2f"),
          _f(r["residual_ratio"], "7.3f"), _f(r["TFLOPs"], "8.1f"),
          "/".join(r["routes"].values()) if r.get("routes") else "") for r in rows])

    print("floor ms: the bytes the step's quantize / amax / dequantize passes must move (benchmarks/traffic.py) at "
          f"the copy bandwidth of the same run; target: every quantized step <= {TARGET_FLOOR}x (bf16 step + floor)")
    print(f"\ntargets ({TARGET_RECIPE}): step <= {TARGET_STEP}x bf16, residual bytes <= {TARGET_RESIDUAL}x bf16")
    results["targets"]["by_shape"] = {}
    for r in (r for r in rows if r["recipe"].split(" [")[0] == TARGET_RECIPE):
        ok_t = None if r["step_ratio"] is None else r["step_ratio"] <= TARGET_STEP
        ok_r = None if r["residual_ratio"] is None else r["residual_ratio"] <= TARGET_RESIDUAL
        where = r["shape_name"] if r["recipe"] == TARGET_RECIPE else f"{r['recipe']} {r['shape_name']}"
        results["targets"]["by_shape"][where] = {"step_ok": ok_t, "residual_ok": ok_r}
        verdict = {True: "MEETS", False: "MISSES", None: "n/a"}
        print(f"  {r['recipe']:<34} {r['shape_name']:<16} step {_f(r['step_ratio'], '.3f')}x: {verdict[ok_t]:<6}  "
              f"residual {_f(r['residual_ratio'], '.3f')}x: {verdict[ok_r]}")
    kernel_rows = [r for r in rows if r.get("routes") and set(r["routes"].values()) == {"kernel"}
                   and r["recipe"].split(" [")[0] in KERNEL_TARGETS]
    if kernel_rows:
        print("jf4_gemm route targets: " + ", ".join(f"{k} <= {v}x bf16" for k, v in KERNEL_TARGETS.items()))
        results["targets"]["kernel_by_row"] = {}
        for r in kernel_rows:
            ok = None if r["step_ratio"] is None else r["step_ratio"] <= KERNEL_TARGETS[r["recipe"].split(" [")[0]]
            results["targets"]["kernel_by_row"][f"{r['recipe']} {r['shape_name']}"] = ok
            print(f"  {r['recipe']:<34} {r['shape_name']:<16} step {_f(r['step_ratio'], '.3f')}x: "
                  f"{ {True: 'MEETS', False: 'MISSES', None: 'n/a'}[ok] }")
    if not native and not results["kernel_gemm"]:
        print("  note: no native block-scaled GEMM and no jf4_gemm kernel on this device; quantized steps use the "
              "emulated GEMM")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")

    bench.write_results(results, args.out)


if __name__ == "__main__":
    main()
