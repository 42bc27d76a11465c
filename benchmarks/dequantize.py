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
The best of `repeats` runs is reported. The scale-layout ops (swizzle / unswizzle) move only the scales (a few MB,
a few µs), so they run over K_SCALES = 32 scale arrays per call (else the Python dispatch, not the GPU, is timed) and
their rows also report a device-to-device copy of the same scale arrays timed the same way ("% same-size copy":
the fraction of what a copy of those bytes reaches, launch and tail effects included). Rows whose output is x's
layout transposed from the stored data (NVFP4 columnwise) also report their bandwidth as a fraction of an XLA
transpose of the bf16 x measured in the same run (jit(jnp.transpose), read + write bytes; "% transpose"), a
reference for what a transposing access pattern reaches on the device.

Usage: python benchmarks/dequantize.py [--shapes default|small|MxK,...] [--variants id,...] [--iters 20]
                                       [--repeats 3] [--out benchmarks/results/dequantize.json]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402

K = 3  # rotated inputs per call
K_SCALES = 32  # scale arrays per call for the swizzle / unswizzle ops
KEY = jax.random.key(0)


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


# ---- accounting -------------------------------------------------------------------------------------------------
def minimal_bytes(v: Variant, q) -> int:
    """What the op must read (the QuantizedArray's leaves it uses) plus what it writes."""
    out = jax.eval_shape(kernel_fn(v), q)
    return bench.tree_bytes(q if v.op == "dequantize" else q.scale) + bench.tree_bytes(out)


def main():
    args, shapes, variants, results = bench.start_matrix_run(__doc__, "dequantize", VARIANTS, "the primitives", K,
                                                             inputs="inputs")
    timing = dict(iters=args.iters, repeats=args.repeats)
    rows, t_start = results["rows"], time.perf_counter()
    results["transpose_GBps"] = {}
    for si, sname, shape, bufs, copy_gbs in bench.shape_buffers(shapes, results, K, KEY, **timing):
        first = si == 0
        transpose_gbs = None  # measured when the first transposing variant of the shape runs
        quantized = {}
        for v in variants:
            key = (v.fmt, v.axis, v.layout)
            if key not in quantized:
                quantize = jax.jit(lambda x, v=v: jax_fp4.quantize(x, v.fmt, axis=v.axis, scale_layout=v.layout))
                quantized[key] = jax.block_until_ready([quantize(b) for b in bufs])
            qs = quantized[key]
            same_size_copy_t = None
            if v.op != "dequantize":  # K_SCALES distinct scale buffers (the ops read nothing else)
                qs = [dataclasses.replace(qs[i % K], scale=jnp.copy(qs[i % K].scale)) for i in range(K_SCALES)]
                same_size_copy_t, _ = bench.time_over_buffers(jnp.copy, [q.scale for q in qs], **timing)
            fn = kernel_fn(v)
            missing = bench.kernels_missing(fn, qs[:1], v.kernels) if first else []
            if missing:
                print(f"warning: {v.id}: no {missing} custom call in the lowering (reference path timed)")
            t, got = bench.time_over_buffers(fn, qs, **timing, keep=first)
            ob = minimal_bytes(v, qs[0])
            t_ref = bit_exact = None
            if first:  # the reference only on the first shape (compile time)
                t_ref, want = bench.time_over_buffers(ref_fn(v), qs[:1], **timing, keep=True)
                bit_exact = bench.bit_exact_check(f"{v.id} [{sname}]", bench.bits_equal, got[0], want[0])
                del got, want
            gbs = ob / t / 1e9
            same_pct = None if same_size_copy_t is None else 100 * same_size_copy_t / t
            transposing = v.op == "dequantize" and v.axis == 0 and isinstance(v.fmt, NVFP4)
            if transposing and transpose_gbs is None:
                t_tr, _ = bench.time_over_buffers(jnp.transpose, bufs, **timing)
                transpose_gbs = results["transpose_GBps"][sname] = 2 * bench.tree_bytes(bufs[0]) / t_tr / 1e9
                print(f"[{sname}] XLA transpose bandwidth {transpose_gbs / 1e3:.2f} TB/s ({t_tr * 1e6:.1f} µs)")
            transpose_pct = 100 * gbs / transpose_gbs if transposing else None
            row = {
                "variant": v.name, "id": v.id, "op": v.op, "shape_name": sname, "shape": list(shape),
                "out_dtype": jnp.dtype(v.dtype).name if v.op == "dequantize" else None, "layout": v.layout,
                "us": t * 1e6, "bytes": ob, "GBps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs,
                "same_size_copy_us": bench.micros(same_size_copy_t), "pct_same_size_copy": same_pct,
                "pct_transpose_bw": transpose_pct,
                "ref_us": bench.micros(t_ref), "speedup_vs_ref": bench.ratio(t_ref, t), "bit_exact_vs_ref": bit_exact,
            }
            rows.append(row)
            same = "" if same_pct is None else f" ({same_pct:.0f}% of a same-size copy)"
            same += "" if transpose_pct is None else f" ({transpose_pct:.0f}% of an XLA transpose)"
            print(f"  {v.name:<30} {row['us']:>9.1f} µs {gbs:>7.0f} GB/s {row['pct_copy_bw']:>5.1f}%{same} "
                  f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)
        del bufs, quantized

    bench.print_summary(results, "bytes = data + scales + amaxes read once, output written once (float4 at 4 bits); "
                        "% same = a same-size copy's µs / this row's µs (scale-layout ops); % transp = this row's "
                        "GB/s / an XLA bf16 transpose's (NVFP4 columnwise); "
                        "vs ref = the jitted reference's µs / this row's µs (first shape only)")

    bench.print_table(
        [("variant", "<30"), ("shape", "<32"), ("µs", ">9"), ("GB/s", ">7"), ("% copy", ">7"), ("% same", ">7"),
         ("% transp", ">8"), ("vs ref", ">8"), ("exact", ">5")],
        [(r["variant"], r["shape_name"], f"{r['us']:.1f}", f"{r['GBps']:.0f}", f"{r['pct_copy_bw']:.1f}%",
          bench.fmt(r["pct_same_size_copy"], ".1f") + ("%" if r["pct_same_size_copy"] is not None else ""),
          bench.fmt(r["pct_transpose_bw"], ".1f") + ("%" if r["pct_transpose_bw"] is not None else ""),
          bench.fmt_speedup(r["speedup_vs_ref"]), bench.fmt_exact(r["bit_exact_vs_ref"])) for r in rows])
    bench.finish_run(results, args.out, t_start)


if __name__ == "__main__":
    main()
