"""Dequantize benchmark (GPU): the jf4_dequantize CUDA kernel (and jf4_swizzle / jf4_unswizzle) vs the reference.

For each shape (x bf16, quantized once up front) and variant it reports µs per call, GB/s over the minimal bytes
(data read once — float4 at 4 bits —, scales, tensor / window amax read once, the output written once), % of the
device-to-device copy bandwidth measured in the same run (jit(jnp.copy) of a bf16 x, read + write bytes), and the
speed-up over the jitted bit-exact reference (`jax_fp4.reference.dequantize`, swizzled scales through
`reference.unswizzle_scales`; `reference.swizzle_scales` / `unswizzle_scales` for the layout variants; first shape
only, it is slow to compile). The first shape also checks the kernel's bits against the reference.

Timing: every function is jitted over K rotated inputs (one call runs it on each of them, so one Python dispatch
covers K kernels and no input stays in L2); after warm-up, up to `iters` calls (fewer for slow functions, about
0.5 s per repeat) are enqueued back to back and the wall time until `jax.block_until_ready` is divided by calls * K.
The best of `repeats` runs is reported.

Usage: python benchmarks/dequantize.py [--shapes default|small|MxK,...] [--variants id,...] [--iters 20]
                                       [--repeats 3] [--out benchmarks/results/dequantize.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src import ffi

SHAPES = {
    "square 8192x8192": (8192, 8192),
    "16384x4096": (16384, 4096),
    "llama3-8b mlp down 16384x14336": (16384, 14336),
}
SMALL_SHAPES = {"small 1024x2048": (1024, 2048)}
K = 3  # rotated inputs per call
KEY = jax.random.key(0)
REPEAT_BUDGET_S = 0.5  # cap on one timed repeat (slow functions run fewer than `iters` calls)


@dataclasses.dataclass(frozen=True)
class Variant:
    id: str
    name: str
    fmt: object
    axis: int = -1
    layout: str = "compact"
    dtype: object = jnp.bfloat16
    op: str = "dequantize"  # or "swizzle" (compact -> swizzled scales) / "unswizzle"

    @property
    def kernels(self) -> tuple[str, ...]:
        return {"dequantize": ("jf4_dequantize",), "swizzle": ("jf4_swizzle",), "unswizzle": ("jf4_unswizzle",)}[
            self.op]


VARIANTS = [
    Variant("nvfp4_row", "nvfp4 row bf16", NVFP4()),
    Variant("nvfp4_row_f32", "nvfp4 row f32", NVFP4(), dtype=jnp.float32),
    Variant("nvfp4_row_swz", "nvfp4 row swizzled bf16", NVFP4(), layout="swizzled"),
    Variant("nvfp4_col", "nvfp4 col bf16 (transposed)", NVFP4(), axis=0),
    Variant("nvfp4_rht_col", "nvfp4 RHT col bf16", NVFP4(rht=True), axis=0),
    Variant("nvfp4_1x64", "nvfp4 1x64 row bf16", NVFP4(local_1x64=True)),
    Variant("nvfp4_1x64_swz", "nvfp4 1x64 row swz bf16", NVFP4(local_1x64=True), layout="swizzled"),
    Variant("mxfp8_row", "mxfp8 row bf16", MXFP8()),
    Variant("mxfp8_row_swz", "mxfp8 row swizzled bf16", MXFP8(), layout="swizzled"),
    Variant("mxfp8_col", "mxfp8 col bf16", MXFP8(), axis=0),
    Variant("mxfp8_col_swz", "mxfp8 col swizzled bf16", MXFP8(), axis=0, layout="swizzled"),
    Variant("swizzle_nvfp4", "swizzle nvfp4 scales", NVFP4(), op="swizzle"),
    Variant("unswizzle_nvfp4", "unswizzle nvfp4 scales", NVFP4(), layout="swizzled", op="unswizzle"),
]


# ---- the timed functions ----------------------------------------------------------------------------------------
def kernel_fn(v: Variant):
    if v.op == "swizzle":
        return lambda q: jax_fp4.swizzle_scales(q).scale
    if v.op == "unswizzle":
        return lambda q: jax_fp4.unswizzle_scales(q).scale
    return lambda q: jax_fp4.dequantize(q, v.dtype)


def ref_fn(v: Variant):
    def compact(q):
        if q.scale_layout == "compact":
            return q.scale
        return reference.unswizzle_scales(q.scale, q.fmt, q.compact_scale_shape(), q.axis)

    if v.op == "swizzle":
        return lambda q: reference.swizzle_scales(q.scale, q.fmt, q.axis)
    if v.op == "unswizzle":
        return compact
    return lambda q: reference.dequantize(q.data, compact(q), q.amax, q.window_amax, q.fmt, q.axis, v.dtype)


# ---- timing / accounting ----------------------------------------------------------------------------------------
def time_fn(fn, inputs, iters, repeats, keep=False):
    """(best seconds per single-input application of fn, outputs of the last call if keep)."""
    f = jax.jit(lambda qs: tuple(fn(q) for q in qs))
    jax.block_until_ready(f(inputs))  # compile + warm-up
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(inputs))
    n = max(1, min(iters, int(REPEAT_BUDGET_S / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(inputs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (n * len(inputs)))
    return best, (out if keep else None)


def nbytes(tree) -> int:
    """Bytes of every leaf: float4 at 4 bits, everything else at its itemsize."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        dt = jnp.dtype(leaf.dtype)
        total += -(-math.prod(leaf.shape) * (4 if dt.name.startswith("float4") else 8 * dt.itemsize) // 8)
    return total


def minimal_bytes(v: Variant, q) -> int:
    """What the op must read (the QuantizedArray's leaves it uses) plus what it writes."""
    out = jax.eval_shape(kernel_fn(v), q)
    if v.op == "dequantize":
        return nbytes(q) + nbytes(out)
    return nbytes(q.scale) + nbytes(out)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def parse_shapes(spec: str) -> dict:
    if spec == "default":
        return SHAPES
    if spec == "small":
        return SMALL_SHAPES
    shapes = {}
    for s in spec.split(","):
        m, k = (int(t) for t in s.lower().split("x"))
        shapes[f"{m}x{k}"] = (m, k)
    return shapes


def parse_variants(spec: str | None) -> list[Variant]:
    if not spec:
        return VARIANTS
    picked = []
    for s in (t.strip() for t in spec.split(",")):
        hit = [v for i, v in enumerate(VARIANTS, 1) if s in (v.id, v.name, str(i))]
        if not hit:
            raise SystemExit(f"unknown variant {s!r}; known: {', '.join(v.id for v in VARIANTS)} "
                             f"(or 1..{len(VARIANTS)})")
        picked += [v for v in hit if v not in picked]
    return picked


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dequantize.json"))
    ap.add_argument("--shapes", default="default", help="default | small (1024x2048) | comma list of MxK")
    ap.add_argument("--variants", default=None, help="comma list of variant ids / names / 1-based numbers")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shapes, variants = parse_shapes(args.shapes), parse_variants(args.variants)

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    if not on_gpu:
        print(f"warning: default device is {dev} (not a GPU); numbers are not representative")
    if not ffi.HAS_CUDA_KERNELS:
        print(f"warning: CUDA extension missing ({ffi.import_error()}); the primitives run the reference")
    results = {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "has_cuda_kernels": ffi.HAS_CUDA_KERNELS,
        "method": f"jit over {K} rotated inputs, best of {args.repeats} x <= {args.iters} calls, block_until_ready",
        "copy_GBps": {},
        "rows": [],
    }
    print(f"device: {results['device']}  jax {results['jax']}  ({results['method']})", flush=True)
    rows = results["rows"]
    t_start = time.perf_counter()
    for si, (sname, shape) in enumerate(shapes.items()):
        bufs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(KEY, K)]
        jax.block_until_ready(bufs)
        x_bytes = math.prod(shape) * 2
        t_copy, _ = time_fn(jnp.copy, bufs, args.iters, args.repeats)
        copy_gbs = 2 * x_bytes / t_copy / 1e9
        results["copy_GBps"][sname] = copy_gbs
        print(f"[{sname}] copy bandwidth {copy_gbs / 1e3:.2f} TB/s ({t_copy * 1e6:.1f} µs)", flush=True)
        first = si == 0
        quantized = {}
        for v in variants:
            key = (v.fmt, v.axis, v.layout)
            if key not in quantized:
                quantize = jax.jit(lambda x, v=v: jax_fp4.quantize(x, v.fmt, axis=v.axis, scale_layout=v.layout))
                quantized[key] = jax.block_until_ready([quantize(b) for b in bufs])
            qs = quantized[key]
            fn = kernel_fn(v)
            if on_gpu and ffi.HAS_CUDA_KERNELS and first:
                text = jax.jit(fn).lower(qs[0]).as_text()
                missing = [k for k in v.kernels if f"custom_call @{k}" not in text]
                if missing:
                    print(f"warning: {v.id}: no {missing} custom call in the lowering (reference path timed)")
            t, got = time_fn(fn, qs, args.iters, args.repeats, keep=first)
            ob = minimal_bytes(v, qs[0])
            t_ref = bit_exact = None
            if first:  # the reference only on the first shape (compile time)
                t_ref, want = time_fn(ref_fn(v), qs[:1], args.iters, args.repeats, keep=True)
                try:
                    bit_exact = bool(np.array_equal(_bits(got[0]), _bits(want[0])))
                except Exception as e:  # report, keep timing
                    print(f"note: {v.id}: reference check skipped ({type(e).__name__}: {str(e)[:200]})")
                if bit_exact is False:
                    print(f"warning: {v.id} [{sname}]: output differs from the reference")
                del got, want
            gbs = ob / t / 1e9
            row = {
                "variant": v.name, "id": v.id, "op": v.op, "shape_name": sname, "shape": list(shape),
                "out_dtype": jnp.dtype(v.dtype).name if v.op == "dequantize" else None, "layout": v.layout,
                "us": t * 1e6, "bytes": ob, "GBps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs,
                "ref_us": None if t_ref is None else t_ref * 1e6,
                "speedup_vs_ref": None if t_ref is None else t_ref / t,
                "bit_exact_vs_ref": bit_exact,
            }
            rows.append(row)
            print(f"  {v.name:<30} {row['us']:>9.1f} µs {gbs:>7.0f} GB/s {row['pct_copy_bw']:>5.1f}% "
                  f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)
        del bufs, quantized

    print(f"\ndevice: {results['device']}  jax {results['jax']}  ({results['method']})")
    bw = ", ".join(f"{s}: {g / 1e3:.2f} TB/s" for s, g in results["copy_GBps"].items())
    print(f"copy bandwidth (D2D, R+W): {bw}")
    print("bytes = data + scales + amaxes read once, output written once (float4 at 4 bits); vs ref = the jitted "
          "reference's µs / this row's µs (first shape only)")
    hdr = f"{'variant':<30} {'shape':<32} {'µs':>9} {'GB/s':>7} {'% copy':>7} {'vs ref':>8} {'exact':>5}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ref = _fmt(r["speedup_vs_ref"], ".1f") + ("x" if r["speedup_vs_ref"] is not None else "")
        exact = {True: "yes", False: "NO", None: ""}[r["bit_exact_vs_ref"]]
        print(f"{r['variant']:<30} {r['shape_name']:<32} {r['us']:>9.1f} {r['GBps']:>7.0f} {r['pct_copy_bw']:>6.1f}% "
              f"{ref:>8} {exact:>5}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
