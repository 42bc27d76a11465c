"""Quantize benchmark (GPU): the jf4_quantize CUDA kernel (NVFP4 / MXFP8 variants) vs the reference and jax.nn.

For each shape (bf16 input) and variant it reports µs per quantize, GB/s over the minimal bytes (x read once plus
every output leaf written once: float4 at 4 bits, the rest at their itemsize), % of the device-to-device copy
bandwidth measured in the same run (jit(jnp.copy), read + write bytes), and the speed-up over the jitted bit-exact
reference (`jax_fp4.reference.quantize`, one call per orientation; first shape only, it is slow to compile) and over
jax.nn's block-scaled quantizer (`jax._src.cudnn.scaled_matmul_stablehlo.quantize`; MXFP8 e4m3 / NVFP4 row and
row+col only, the latter as quantize(x) + quantize(x.T)).

Modes: "e2e" is the public API (includes the tensor-amax pass that re-reads x for NVFP4); "kernel" binds the
quantize primitive with the tensor amax (and SR key words) precomputed outside the timed function and passed as
jitted arguments, which isolates the quantize kernel.

Timing: every function is jitted over K rotated input buffers (one call runs it on each of them, so one Python
dispatch covers K kernels and no input stays in L2); after warm-up, up to `iters` calls (fewer for slow functions,
about 0.5 s per repeat) are enqueued back to back and the wall time until `jax.block_until_ready` is divided by
calls * K. The best of `repeats` runs is reported. The reference runs on one buffer (compile time).

Usage: python benchmarks/quantize.py [--shapes default|small|MxK,...] [--variants id,...] [--iters 20]
                                     [--repeats 3] [--out benchmarks/results/quantize.json]
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
from jax_fp4._src.primitives.quantize import quantize_3d
from jax_fp4._src.primitives.rht_amax import rht_amax
from jax_fp4.reference.sr import philox_key

try:
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jnn_quantize
    from jax._src.nn.functions import get_scaled_dot_general_config
except Exception as e:  # private jax API: any failure means n/a
    jnn_quantize = get_scaled_dot_general_config = None
    JNN_IMPORT_ERROR = repr(e)
else:
    JNN_IMPORT_ERROR = None

SHAPES = {
    "square 8192x8192": (8192, 8192),
    "16384x4096": (16384, 4096),
    "llama3-8b mlp down 16384x14336": (16384, 14336),
}
SMALL_SHAPES = {"small 1024x2048": (1024, 2048)}
K = 3  # rotated buffers per call
KEY = jax.random.key(0)
REPEAT_BUDGET_S = 0.5  # cap on one timed repeat (slow functions run fewer than `iters` calls)


@dataclasses.dataclass(frozen=True)
class Variant:
    id: str
    name: str
    row: object  # Format | None
    col: object  # Format | None
    axis: int | None = None  # -1 / 0: single-orientation jax_fp4.quantize; None: quantize_rowwise_columnwise
    layout: str = "compact"
    dbias: bool = False
    jnn: str | None = None  # "mxfp8" / "nvfp4": the jax.nn comparison

    @property
    def fmts(self):
        return [f for f in (self.row, self.col) if f is not None]

    @property
    def sr(self) -> bool:
        return any(_sr(f) for f in self.fmts)

    @property
    def kernel_only(self) -> bool:
        return any(isinstance(f, NVFP4) and f.has_tensor_amax for f in self.fmts)


def _sr(f) -> bool:
    return isinstance(f, NVFP4) and f.stochastic_rounding


VARIANTS = [
    Variant("nvfp4_row", "nvfp4 row", NVFP4(), None, axis=-1, jnn="nvfp4"),
    Variant("nvfp4_rowcol", "nvfp4 row+col", NVFP4(), NVFP4(), jnn="nvfp4"),
    Variant("mxfp8_row", "mxfp8 row", MXFP8(), None, axis=-1, jnn="mxfp8"),
    Variant("mxfp8_rowcol", "mxfp8 row+col", MXFP8(), MXFP8(), jnn="mxfp8"),
    Variant("mixed", "nvfp4 row + mxfp8 col", NVFP4(), MXFP8()),
    Variant("mxfp8_rowcol_dbias", "mxfp8 row+col + dbias", MXFP8(), MXFP8(), dbias=True),
    Variant("nvfp4_2d", "nvfp4 2D row+col", NVFP4(scaling_2d=True), NVFP4(scaling_2d=True)),
    Variant("nvfp4_rht_col", "nvfp4 RHT col", None, NVFP4(rht=True), axis=0),
    Variant("nvfp4_sr", "nvfp4 SR row+col", NVFP4(stochastic_rounding=True), NVFP4(stochastic_rounding=True)),
    Variant("nvfp4_1x64", "nvfp4 1x64 row+col", NVFP4(local_1x64=True), NVFP4(local_1x64=True)),
    Variant("nvfp4_swizzled", "nvfp4 row+col swizzled", NVFP4(), NVFP4(), layout="swizzled"),
]


# ---- the timed functions ----------------------------------------------------------------------------------------
def e2e_fn(v: Variant):
    key = KEY if v.sr else None
    if v.axis is not None:
        fmt = v.row if v.axis == -1 else v.col
        return lambda x: jax_fp4.quantize(x, fmt, axis=v.axis, key=key, scale_layout=v.layout)
    return lambda x: jax_fp4.quantize_rowwise_columnwise(x, v.row, v.col, key=key, scale_layout=v.layout,
                                                         dbias=v.dbias)


def aux_fn(v: Variant):
    """x -> (amax_row, amax_col, key_row, key_col): the kernel's precomputed operands (as the public API makes them)."""

    def tensor_scale(x, x3, f, orient):
        if not (isinstance(f, NVFP4) and f.has_tensor_amax):
            return jnp.zeros((1,), jnp.float32)
        a = jnp.max(rht_amax(x3, orient)) if f.rht else jax_fp4.tensor_amax(x)
        return jnp.reshape(a, (1,)).astype(jnp.float32)

    def fn(x):
        x3 = x.reshape(1, *x.shape)
        keys = jax.random.split(KEY) if v.axis is None else (KEY, KEY)
        zero = jnp.zeros((2,), jnp.uint32)
        kw = [philox_key(k) if _sr(f) else zero for f, k in zip((v.row, v.col), keys, strict=True)]
        return tensor_scale(x, x3, v.row, "row"), tensor_scale(x, x3, v.col, "col"), kw[0], kw[1]

    return fn


def kernel_fn(v: Variant):
    def fn(x, amax_row, amax_col, key_row, key_col):
        return quantize_3d(x.reshape(1, *x.shape), amax_row, amax_col, key_row, key_col, row_fmt=v.row,
                           col_fmt=v.col, scale_layout=v.layout, dbias=v.dbias)

    return fn


def ref_fn(v: Variant):
    def fn(x):
        keys = jax.random.split(KEY) if v.axis is None else (KEY, KEY)
        outs = []
        for f, axis, k in ((v.row, -1, keys[0]), (v.col, 0, keys[1])):
            if f is None:
                continue
            q = reference.quantize(x, f, axis=axis, key=k if _sr(f) else None)
            if v.layout == "swizzled":
                q = q._replace(scale=reference.swizzle_scales(q.scale, f, axis))
            outs.append(q)
        if v.dbias:
            outs.append(jnp.sum(x.astype(jnp.float32), axis=0))
        return tuple(outs)

    return fn


def jnn_fn(v: Variant):
    if v.jnn is None or jnn_quantize is None:
        return None

    def one(y):
        if v.jnn == "mxfp8":
            cfg = get_scaled_dot_general_config("mxfp8")
        else:  # NVFP4 global scale from the tensor amax: amax / (6 * 448)
            gs = jnp.max(jnp.abs(y)).astype(jnp.float32) / (6.0 * 448.0)
            cfg = get_scaled_dot_general_config("nvfp4", global_scale=gs.reshape(1))
        return jnn_quantize(y, cfg)

    return (lambda x: one(x)) if v.row is None or v.col is None else (lambda x: (one(x), one(x.T)))


# ---- timing / accounting ----------------------------------------------------------------------------------------
def time_fn(fn, bufs, auxs, iters, repeats, keep=False):
    """(best seconds per single-buffer application of fn(x, *aux), outputs of the last call if keep)."""
    f = jax.jit(lambda xs, ays: tuple(fn(x, *a) for x, a in zip(xs, ays, strict=True)))
    jax.block_until_ready(f(bufs, auxs))  # compile + warm-up
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(bufs, auxs))
    n = max(1, min(iters, int(REPEAT_BUDGET_S / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(bufs, auxs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (n * len(bufs)))
    return best, (out if keep else None)


def out_bytes(fn, x, *aux) -> int:
    """Bytes of every leaf fn(x, *aux) returns: float4 at 4 bits, everything else at its itemsize."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(jax.eval_shape(fn, x, *aux)):
        dt = jnp.dtype(leaf.dtype)
        bits = 4 if dt.name.startswith("float4") else 8 * dt.itemsize
        total += -(-math.prod(leaf.shape) * bits // 8)
    return total


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def check_vs_reference(v: Variant, got, want) -> bool:
    """Data codes (and compact scales) of each orientation equal the reference's, bit for bit."""
    qs = [got] if v.axis is not None else [q for q in got[:2] if q is not None]
    ok = True
    for q, r in zip(qs, want, strict=False):  # want may end with dbias
        ok &= np.array_equal(_bits(q.data), _bits(r.data))
        if v.layout == "compact":
            ok &= np.array_equal(_bits(q.scale), _bits(r.scale))
    return bool(ok)


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
            known = ", ".join(v.id for v in VARIANTS)
            raise SystemExit(f"unknown variant {s!r}; known: {known} (or 1..{len(VARIANTS)})")
        picked += [v for v in hit if v not in picked]
    return picked


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quantize.json"))
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
        print(f"warning: CUDA extension missing ({ffi.import_error()}); 'jf4_quantize' runs the reference")
    if JNN_IMPORT_ERROR:
        print(f"note: jax.nn quantizer unavailable ({JNN_IMPORT_ERROR}); its column reads n/a")
    results = {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "has_cuda_kernels": ffi.HAS_CUDA_KERNELS,
        "method": f"jit over {K} rotated buffers, best of {args.repeats} x <= {args.iters} calls, block_until_ready",
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
        no_aux = [()] * K
        t_copy, _ = time_fn(jnp.copy, bufs, no_aux, args.iters, args.repeats)
        copy_gbs = 2 * x_bytes / t_copy / 1e9
        results["copy_GBps"][sname] = copy_gbs
        print(f"[{sname}] copy bandwidth {copy_gbs / 1e3:.2f} TB/s ({t_copy * 1e6:.1f} µs)", flush=True)
        first = si == 0
        for v in variants:
            fn = e2e_fn(v)
            if first and on_gpu and ffi.HAS_CUDA_KERNELS and "jf4_quantize" not in jax.jit(fn).lower(bufs[0]).as_text():
                print(f"warning: {v.id}: no jf4_quantize custom call in the lowering (reference path timed)")
            t_e2e, got = time_fn(fn, bufs, no_aux, args.iters, args.repeats, keep=first)
            timed = [("e2e", t_e2e, out_bytes(fn, bufs[0]))]
            if v.kernel_only:
                aux = jax.jit(aux_fn(v))
                auxs = [jax.block_until_ready(aux(b)) for b in bufs]
                kfn = kernel_fn(v)
                t_k, _ = time_fn(kfn, bufs, auxs, args.iters, args.repeats)
                timed.append(("kernel", t_k, out_bytes(kfn, bufs[0], *auxs[0])))
                del auxs
            t_ref = bit_exact = None
            if first:  # the reference only on the first shape (compile time)
                t_ref, want = time_fn(ref_fn(v), bufs[:1], no_aux[:1], args.iters, args.repeats, keep=True)
                try:
                    bit_exact = check_vs_reference(v, got[0], want[0])
                except Exception as e:  # e.g. a host copy of float4 unsupported: report, keep timing
                    print(f"note: {v.id}: reference check skipped ({type(e).__name__}: {str(e)[:200]})")
                if bit_exact is False:
                    print(f"warning: {v.id} [{sname}]: output differs from the reference")
                del got, want
            t_jnn, jfn = None, jnn_fn(v)
            if jfn is not None:
                try:
                    t_jnn, _ = time_fn(jfn, bufs, no_aux, args.iters, args.repeats)
                except Exception as e:  # private jax API: report n/a
                    print(f"note: jax.nn quantize failed for {v.id}: {type(e).__name__}: {str(e)[:200]}")
            for mode, t, ob in timed:
                gbs = (x_bytes + ob) / t / 1e9
                row = {
                    "variant": v.name, "id": v.id, "shape_name": sname, "shape": list(shape), "mode": mode,
                    "us": t * 1e6, "bytes": x_bytes + ob, "GBps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs,
                    "ref_us": None if t_ref is None else t_ref * 1e6,
                    "jnn_us": None if t_jnn is None else t_jnn * 1e6,
                    "speedup_vs_ref": None if t_ref is None else t_ref / t,
                    "speedup_vs_jnn": None if t_jnn is None else t_jnn / t,
                    "bit_exact_vs_ref": bit_exact if mode == "e2e" else None,
                }
                rows.append(row)
                print(f"  {v.name:<24} {mode:<6} {row['us']:>9.1f} µs {gbs:>7.0f} GB/s "
                      f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)
        del bufs

    print(f"\ndevice: {results['device']}  jax {results['jax']}  ({results['method']})")
    bw = ", ".join(f"{s}: {g / 1e3:.2f} TB/s" for s, g in results["copy_GBps"].items())
    print(f"copy bandwidth (D2D, R+W): {bw}")
    print("bytes = x read once + all outputs written once; speed-ups are the other's µs / this row's µs; "
          "ref timed on the first shape only; e2e includes the tensor-amax pass, kernel does not")
    hdr = (f"{'variant':<24} {'shape':<32} {'mode':<6} {'µs':>9} {'GB/s':>7} {'% copy':>7} {'vs ref':>8} "
           f"{'vs jax.nn':>9} {'exact':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        jnn = _fmt(r["speedup_vs_jnn"], ".2f", "n/a" if r["id"] in ("nvfp4_row", "nvfp4_rowcol", "mxfp8_row",
                                                                      "mxfp8_rowcol") else "-")
        jnn = jnn + "x" if r["speedup_vs_jnn"] is not None else jnn
        ref = _fmt(r["speedup_vs_ref"], ".1f") + ("x" if r["speedup_vs_ref"] is not None else "")
        exact = {True: "yes", False: "NO", None: ""}[r["bit_exact_vs_ref"]]
        print(f"{r['variant']:<24} {r['shape_name']:<32} {r['mode']:<6} {r['us']:>9.1f} {r['GBps']:>7.0f} "
              f"{r['pct_copy_bw']:>6.1f}% {ref:>8} {jnn:>9} {exact:>5}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
