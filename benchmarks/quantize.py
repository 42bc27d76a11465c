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

import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

import jax_fp4
from jax_fp4 import MXFP8, NVFP4, reference
from jax_fp4._src.primitives.quantize import quantize_3d
from jax_fp4._src.primitives.rht_amax import rht_amax
from jax_fp4.reference.sr import philox_key

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402

try:
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jnn_quantize
    from jax._src.nn.functions import get_scaled_dot_general_config
except Exception as e:  # private jax API: any failure means n/a
    jnn_quantize = get_scaled_dot_general_config = None
    JNN_IMPORT_ERROR = repr(e)
else:
    JNN_IMPORT_ERROR = None

K = 3  # rotated buffers per call
KEY = jax.random.key(0)


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
    # 4over6 (two candidate encodes and their errors per block) next to the plain variants above
    Variant("nvfp4_4over6_row", "nvfp4 4over6 row", NVFP4(use_4over6=True), None, axis=-1),
    Variant("nvfp4_4over6_rowcol", "nvfp4 4over6 row+col", NVFP4(use_4over6=True), NVFP4(use_4over6=True)),
    Variant("nvfp4_4over6_mixed", "nvfp4 4over6 row + mxfp8 col", NVFP4(use_4over6=True), MXFP8()),
    Variant("nvfp4_4over6_2d", "nvfp4 4over6 2D row+col", NVFP4(use_4over6=True, scaling_2d=True),
            NVFP4(use_4over6=True, scaling_2d=True)),
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


# ---- accounting -------------------------------------------------------------------------------------------------
def out_bytes(fn, x, *aux) -> int:
    """Bytes of every leaf fn(x, *aux) returns: float4 at 4 bits, everything else at its itemsize."""
    return bench.tree_bytes(jax.eval_shape(fn, x, *aux))


def check_vs_reference(v: Variant, got, want) -> bool:
    """Data codes (and compact scales) of each orientation equal the reference's, bit for bit."""
    qs = [got] if v.axis is not None else [q for q in got[:2] if q is not None]
    ok = True
    for q, r in zip(qs, want, strict=False):  # want may end with dbias
        ok &= bench.bits_equal(q.data, r.data)
        if v.layout == "compact":
            ok &= bench.bits_equal(q.scale, r.scale)
    return bool(ok)


def main():
    if JNN_IMPORT_ERROR:
        print(f"note: jax.nn quantizer unavailable ({JNN_IMPORT_ERROR}); its column reads n/a")
    args, shapes, variants, results = bench.start_matrix_run(__doc__, "quantize", VARIANTS, "'jf4_quantize'", K)
    timing = dict(iters=args.iters, repeats=args.repeats)
    rows, t_start = results["rows"], time.perf_counter()
    for si, sname, shape, bufs, copy_gbs in bench.shape_buffers(shapes, results, K, KEY, **timing):
        x_bytes = math.prod(shape) * 2
        first = si == 0
        for v in variants:
            fn = e2e_fn(v)
            if first and bench.kernels_missing(fn, bufs[:1], ["jf4_quantize"]):
                print(f"warning: {v.id}: no jf4_quantize custom call in the lowering (reference path timed)")
            t_e2e, got = bench.time_over_buffers(fn, bufs, **timing, keep=first)
            timed = [("e2e", t_e2e, out_bytes(fn, bufs[0]))]
            if v.kernel_only:
                aux = jax.jit(aux_fn(v))
                auxs = [jax.block_until_ready(aux(b)) for b in bufs]
                kfn = kernel_fn(v)
                t_k, _ = bench.time_over_buffers(kfn, bufs, **timing, auxs=auxs)
                timed.append(("kernel", t_k, out_bytes(kfn, bufs[0], *auxs[0])))
                del auxs
            t_ref = bit_exact = None
            if first:  # the reference only on the first shape (compile time)
                t_ref, want = bench.time_over_buffers(ref_fn(v), bufs[:1], **timing, keep=True)
                bit_exact = bench.bit_exact_check(f"{v.id} [{sname}]", check_vs_reference, v, got[0], want[0])
                del got, want
            t_jnn, jfn = None, jnn_fn(v)
            if jfn is not None:
                try:
                    t_jnn, _ = bench.time_over_buffers(jfn, bufs, **timing)
                except Exception as e:  # private jax API: report n/a
                    print(f"note: jax.nn quantize failed for {v.id}: {type(e).__name__}: {str(e)[:200]}")
            for mode, t, ob in timed:
                gbs = (x_bytes + ob) / t / 1e9
                row = {
                    "variant": v.name, "id": v.id, "shape_name": sname, "shape": list(shape), "mode": mode,
                    "us": t * 1e6, "bytes": x_bytes + ob, "GBps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs,
                    "ref_us": bench.micros(t_ref), "jnn_us": bench.micros(t_jnn),
                    "speedup_vs_ref": bench.ratio(t_ref, t), "speedup_vs_jnn": bench.ratio(t_jnn, t),
                    "bit_exact_vs_ref": bit_exact if mode == "e2e" else None,
                }
                rows.append(row)
                print(f"  {v.name:<24} {mode:<6} {row['us']:>9.1f} µs {gbs:>7.0f} GB/s "
                      f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)
        del bufs

    bench.print_summary(results, "bytes = x read once + all outputs written once; speed-ups are the other's µs / "
                        "this row's µs; ref timed on the first shape only; e2e includes the tensor-amax pass, kernel "
                        "does not")
    jnn_ids = {v.id for v in VARIANTS if v.jnn}
    bench.print_table(
        [("variant", "<24"), ("shape", "<32"), ("mode", "<6"), ("µs", ">9"), ("GB/s", ">7"), ("% copy", ">7"),
         ("vs ref", ">8"), ("vs jax.nn", ">9"), ("exact", ">5")],
        [(r["variant"], r["shape_name"], r["mode"], f"{r['us']:.1f}", f"{r['GBps']:.0f}", f"{r['pct_copy_bw']:.1f}%",
          bench.fmt_speedup(r["speedup_vs_ref"]),
          bench.fmt_speedup(r["speedup_vs_jnn"], ".2f", "n/a" if r["id"] in jnn_ids else "-"),
          bench.fmt_exact(r["bit_exact_vs_ref"])) for r in rows])
    bench.finish_run(results, args.out, t_start)


if __name__ == "__main__":
    main()
