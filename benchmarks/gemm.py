"""Block-scaled GEMM benchmark (GPU): the `jf4_gemm` kernel route and today's emulated route of
`jax_fp4.scaled_dot_general`, against cuBLAS bf16 (`lax.dot_general` of bfloat16 operands) in the same run.

Per shape (out[M, N] = a[M, K] . b[N, K], both operands K-major, bfloat16 output) it times:
  bf16             lax.dot_general(x, w) of the bfloat16 inputs, bfloat16 result (cuBLAS): the baseline
  <fmt> kernel     scaled_dot_general(..., implementation="kernel"): packed codes, block scales and tensor / window
                   amax decoded on chip (jf4_gemm, compute capability 9.x; "n/a" elsewhere)
  <fmt> emulated   scaled_dot_general(..., implementation="emulated"): the dequantize pass to the exact bfloat16
                   operands (float32 for 1x64) and an XLA dot (the route before jf4_gemm)
for fmt in mxfp8 (E4M3 x E4M3), nvfp4 (1D x 1D), nvfp4-1x64. The operands are quantized once, outside the timing.
TFLOP/s = 2*M*N*K / time; "vs bf16" is the ratio of TFLOP/s to the bf16 row of the same shape. "rel err" is
max |kernel - emulated| / max |emulated| of the two routes' outputs (fp32 accumulation order only; 1x64 also its
window-factor roundings). Targets: MXFP8 and NVFP4 >= 0.90x bf16, NVFP4 1x64 >= 0.80x.

Timing: one jitted GEMM over NBUF rotated operand sets (fewer when they would not fit in MEM_CAP_BYTES), 2 warm-up
calls, then up to `iters` calls enqueued back to back, wall time until `jax.block_until_ready` / calls; best of
`repeats` (`_common.time_calls`).

Usage: python benchmarks/gemm.py [--shapes default|small|8192^3,llama3-8b 4096->4096,...|MxKxN]
                                 [--variants bf16,nvfp4 kernel,...] [--iters 20] [--repeats 3]
                                 [--out benchmarks/results/gemm.json]
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fp4 import MXFP8, NVFP4, quantize, scaled_dot_general
from jax_fp4.gemm import kernel_gemm_available

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402

SHAPES = {  # name: (M, K, N)
    "8192^3": (8192, 8192, 8192),
    "llama3-8b 4096->4096": (16384, 4096, 4096),
    "llama3-8b 4096->1024": (16384, 4096, 1024),
    "llama3-8b 4096->14336": (16384, 4096, 14336),
    "llama3-8b 14336->4096": (16384, 14336, 4096),
}
SMALL_SHAPES = {"small 1024x512x256": (1024, 512, 256)}
NBUF = 2
MEM_CAP_BYTES = 8 << 30
TN = (((1,), (1,)), ((), ()))
FORMATS = {"mxfp8": MXFP8(), "nvfp4": NVFP4(), "nvfp4-1x64": NVFP4(local_1x64=True)}
TARGETS = {"mxfp8": 0.90, "nvfp4": 0.90, "nvfp4-1x64": 0.80}  # kernel TFLOP/s / bf16 TFLOP/s


class Variant(NamedTuple):
    id: str
    name: str
    fmt: str | None  # key of FORMATS, None for bf16
    route: str  # "bf16", "kernel", "emulated"


VARIANTS = [Variant("bf16", "bf16", None, "bf16")] + [
    Variant(f"{f} {r}", f"{f} {r}", f, r) for f in FORMATS for r in ("kernel", "emulated")]


@functools.partial(jax.jit, static_argnames=("route",))
def run_gemm(a, b, route):
    if route == "bf16":
        return jax.lax.dot_general(a, b, TN, preferred_element_type=jnp.bfloat16)
    return scaled_dot_general(a, b, TN, jnp.bfloat16, implementation=route)


@functools.partial(jax.jit, static_argnames=("fmt",))
def quantize_pair(x, w, fmt):
    return quantize(x, fmt), quantize(w, fmt)


def make_inputs(m, k, n, nbuf):
    """nbuf bfloat16 (x [m, k], w [n, k]) pairs: unit-normal activations, weights scaled by 1/sqrt(k)."""
    sets = []
    for i in range(nbuf):
        kx, kw = jax.random.split(jax.random.key(200 + i))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        sets.append(jax.block_until_ready((x, w)))
    return sets


@jax.jit
def rel_err(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))


_f = functools.partial(bench.fmt, missing="n/a")


def main():
    ap = bench.base_parser(__doc__, "gemm", iters=20, repeats=3, variants=True,
                           shapes_help="default | small | comma list of " + ", ".join(SHAPES) + " | MxKxN")
    args = ap.parse_args()
    shapes = bench.parse_shapes(args.shapes, SHAPES, SMALL_SHAPES, dims=3)
    variants = bench.parse_variants(args.variants, VARIANTS)
    if variants[0].route != "bf16":
        variants.insert(0, VARIANTS[0])  # the baseline always runs
    dev = bench.setup_device("'jf4_gemm'")
    kernel = kernel_gemm_available()
    results = {**bench.run_info(dev), "kernel_gemm": kernel,
               "method": (f"one jitted GEMM over <= {NBUF} rotated operand sets, 2 warm-up calls, best of "
                          f"{args.repeats} x <= {args.iters} calls, block_until_ready"),
               "targets": TARGETS, "rows": []}
    print(f"{bench.describe_run(results)}\njf4_gemm kernel: {kernel}", flush=True)
    rows, t_start = results["rows"], time.perf_counter()
    for sname, (m, k, n) in shapes.items():
        nbuf = max(1, min(NBUF, MEM_CAP_BYTES // (2 * (m * k + n * k))))
        inputs = make_inputs(m, k, n, nbuf)
        flops = 2 * m * n * k
        print(f"[{sname}] a [{m}, {k}] b [{n}, {k}], {nbuf} operand set(s)", flush=True)
        base, outs = None, {}
        for v in variants:
            row = {"variant": v.id, "shape_name": sname, "shape": {"M": m, "K": k, "N": n}, "ms": None,
                   "TFLOPs": None, "vs_bf16": None, "rel_err_vs_emulated": None}
            try:
                if v.route == "kernel" and not kernel:
                    raise RuntimeError("no jf4_gemm kernel on this device")
                argsets = inputs if v.fmt is None else [quantize_pair(x, w, FORMATS[v.fmt]) for x, w in inputs]
                fn = functools.partial(run_gemm, route=v.route)
                t, _ = bench.time_calls(fn, argsets, args.iters, args.repeats, warmup=2)
                row["ms"], row["TFLOPs"] = t * 1e3, flops / t / 1e12
                if v.fmt is not None:
                    outs[v.id] = fn(*argsets[0])
                del argsets
            except Exception as e:  # e.g. no kernel here: n/a
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  note: {v.id} [{sname}]: {row['error']}", flush=True)
            if v.route == "bf16":
                base = row["TFLOPs"]
            if row["TFLOPs"] is not None and base:
                row["vs_bf16"] = row["TFLOPs"] / base
            rows.append(row)
            print(f"  {v.id:<22} {_f(row['ms'], '9.3f'):>9} ms {_f(row['TFLOPs'], '7.1f'):>7} TFLOP/s "
                  f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)
        for r in rows:
            if r["shape_name"] == sname and r["variant"].endswith(" kernel"):
                f = r["variant"].removesuffix(" kernel")
                if r["variant"] in outs and f"{f} emulated" in outs:
                    r["rel_err_vs_emulated"] = float(rel_err(outs[r["variant"]], outs[f"{f} emulated"]))
        del inputs, outs

    print(f"\n{bench.describe_run(results)}  jf4_gemm kernel: {kernel}")
    print("out[M, N] = a[M, K] . b[N, K], bfloat16 output; TFLOP/s = 2*M*N*K / time; vs bf16 = TFLOP/s ratio to "
          "lax.dot_general bf16 (cuBLAS) of the same shape")
    bench.print_table(
        [("variant", "<22"), ("shape", "<24"), ("ms", ">9"), ("TFLOP/s", ">8"), ("vs bf16", ">8"), ("rel err", ">9")],
        [(r["variant"], r["shape_name"], _f(r["ms"], "9.3f"), _f(r["TFLOPs"], "8.1f"), _f(r["vs_bf16"], "7.3f"),
          _f(r["rel_err_vs_emulated"], "9.2e")) for r in rows])
    print("\ntargets (kernel TFLOP/s vs bf16): " + ", ".join(f"{f} >= {t:.2f}x" for f, t in TARGETS.items()))
    results["targets_met"] = {}
    for r in rows:
        f = r["variant"].removesuffix(" kernel")
        if r["variant"].endswith(" kernel") and f in TARGETS:
            ok = None if r["vs_bf16"] is None else r["vs_bf16"] >= TARGETS[f]
            results["targets_met"].setdefault(r["shape_name"], {})[f] = ok
            print(f"  {f:<12} {r['shape_name']:<24} {_f(r['vs_bf16'], '.3f')}x: "
                  f"{ {True: 'MEETS', False: 'MISSES', None: 'n/a'}[ok] }")
    bench.finish_run(results, args.out, t_start)


if __name__ == "__main__":
    main()
