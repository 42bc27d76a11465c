"""Grouped (MoE) quantize / dequantize benchmark (GPU): the jf4_grouped_* CUDA kernels vs a loop of single-tensor calls.

For each buffer shape [T, K] (bf16, T tokens sorted by expert) and group count N (uneven group sizes drawn once per N
with a fixed seed, multiples of 32 summing to T, empty groups possible), every variant reports µs per call, GB/s over
the minimal bytes (inputs read once plus every output leaf written once: float4 at 4 bits, the rest at their
itemsize), % of the device-to-device copy bandwidth measured in the same run (jit(jnp.copy), read + write bytes),
and the speed-up over a Python loop of N single-tensor `jax_fp4.quantize` / `jax_fp4.dequantize` calls on static
slices under one jit (the group sizes known at trace time: what a grouped call replaces). The grouped calls take
the sizes as a traced device array (a router's output). Quantize is the public API: "e2e" variants include the
per-group amax pass for NVFP4 (a second read of x); "kernel" variants (NVFP4 only, id suffix _kernel) pass the
per-group amaxes (computed outside the timed function, as jitted arguments: `row_amax` / `col_amax`), which isolates
the quantize kernel as benchmarks/quantize.py's kernel mode does; their loop passes each group's amax too
(`reference.nvfp4.quantize_with_amax` semantics, through the single-tensor primitive). Dequantize runs on the grouped
quantization of the same buffers. The first shape also checks that
every group equals the loop's result bit for bit (data and scales).

Timing: every function is jitted over K rotated input buffers (one call runs it on each of them, so one Python
dispatch covers K kernels and no input stays in L2); after warm-up, up to `iters` calls (fewer for slow functions,
about 0.5 s per repeat) are enqueued back to back and the wall time until `jax.block_until_ready` is divided by
calls * K. The best of `repeats` runs is reported (benchmarks/_common.py).

Usage: python benchmarks/grouped.py [--shapes default|small|TxK,...] [--groups 8,64] [--variants id,...]
                                    [--iters 20] [--repeats 3] [--out benchmarks/results/grouped.json]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402

import jax_fp4  # noqa: E402
from jax_fp4 import MXFP8, NVFP4  # noqa: E402
from jax_fp4._src.primitives.quantize import quantize_3d  # noqa: E402


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Single:
    """A loop entry of kernel mode: one group's data / scale (the fields check_groups reads)."""
    data: jax.Array
    scale: jax.Array
    fmt: object = dataclasses.field(metadata=dict(static=True))

SHAPES = {"16384x4096": (16384, 4096), "moe down 16384x7168": (16384, 7168)}
SMALL_SHAPES = {"small 1024x512": (1024, 512)}
K = 3  # rotated buffers per call
KEY = jax.random.key(0)
ALIGN = 32  # group sizes are multiples of both block sizes (every orientation is valid for every format)


@dataclasses.dataclass(frozen=True)
class Variant:
    id: str
    name: str
    row: object  # Format | None
    col: object  # Format | None
    dequantize: bool = False  # dequantize the (single) present orientation to bf16
    kernel: bool = False  # NVFP4 amaxes given (kernel mode)


VARIANTS = [
    Variant("nvfp4_row", "nvfp4 row", NVFP4(), None),
    Variant("nvfp4_rowcol", "nvfp4 row+col", NVFP4(), NVFP4()),
    Variant("mxfp8_row", "mxfp8 row", MXFP8(), None),
    Variant("mxfp8_rowcol", "mxfp8 row+col", MXFP8(), MXFP8()),
    Variant("mixed", "nvfp4 row + mxfp8 col", NVFP4(), MXFP8()),
    Variant("nvfp4_rht_col", "nvfp4 RHT col", None, NVFP4(rht=True)),
    Variant("nvfp4_row_kernel", "nvfp4 row (kernel)", NVFP4(), None, kernel=True),
    Variant("nvfp4_rowcol_kernel", "nvfp4 row+col (kernel)", NVFP4(), NVFP4(), kernel=True),
    Variant("mixed_kernel", "nvfp4 row + mxfp8 col (kernel)", NVFP4(), MXFP8(), kernel=True),
    Variant("nvfp4_rht_col_kernel", "nvfp4 RHT col (kernel)", None, NVFP4(rht=True), kernel=True),
    Variant("dq_nvfp4_row", "dequantize nvfp4 row", NVFP4(), None, dequantize=True),
    Variant("dq_nvfp4_col", "dequantize nvfp4 col", None, NVFP4(), dequantize=True),
    Variant("dq_nvfp4_rht_col", "dequantize nvfp4 RHT col", None, NVFP4(rht=True), dequantize=True),
    Variant("dq_mxfp8_row", "dequantize mxfp8 row", MXFP8(), None, dequantize=True),
]


def group_sizes(total: int, n: int, seed: int = 0) -> np.ndarray:
    """n uneven sizes (multiples of ALIGN, some possibly 0) summing to `total` (a multiple of ALIGN)."""
    rng = np.random.default_rng([seed, n])
    w = rng.gamma(0.7, size=n)
    units = np.floor(w / w.sum() * (total // ALIGN)).astype(np.int64)
    units[np.argmax(w)] += total // ALIGN - units.sum()
    return (units * ALIGN).astype(np.int32)


# ---- the timed functions ----------------------------------------------------------------------------------------
def grouped_quantize_fn(v: Variant):
    def fn(x, sizes, row_amax=None, col_amax=None):
        row, col, _ = jax_fp4.grouped_quantize_rowwise_columnwise(x, sizes, v.row, v.col, row_amax=row_amax,
                                                                  col_amax=col_amax)
        return tuple(q for q in (row, col) if q is not None)

    return fn


def given_amaxes(v: Variant, x, dsizes):
    """(row_amax, col_amax) of a kernel-mode variant: each NVFP4 orientation's per-group amaxes (else None)."""
    row, col, _ = jax.jit(lambda x, s: jax_fp4.grouped_quantize_rowwise_columnwise(x, s, v.row, v.col))(x, dsizes)
    return tuple(q.amax if q is not None and isinstance(q.fmt, NVFP4) else None for q in (row, col))


def loop_quantize_fn(v: Variant, sizes: np.ndarray):
    off = np.concatenate([[0], np.cumsum(sizes)])

    def fn(x, row_amax=None, col_amax=None):
        outs = []
        for g in range(len(sizes)):
            xg = x[off[g] : off[g + 1]]
            if xg.shape[0] == 0:
                continue
            for fmt, axis, amax in ((v.row, -1, row_amax), (v.col, 0, col_amax)):
                if fmt is None:
                    continue
                if amax is None:
                    outs.append(jax_fp4.quantize(xg, fmt, axis=axis))
                else:  # kernel mode: the single-tensor quantize primitive with the group's amax
                    outs.append(single_with_amax(xg, fmt, axis, amax[g]))
        return tuple(outs)

    return fn


def single_with_amax(xg, fmt, axis, amax):
    """(data, scale) of the single-tensor NVFP4 quantize of xg with a given tensor amax (quantize_3d primitive)."""
    a, kw, orient = jnp.full((1,), amax, jnp.float32), jnp.zeros((2,), jnp.uint32), "row" if axis == -1 else "col"
    o = quantize_3d(xg[None], a, a, kw, kw, row_fmt=fmt if axis == -1 else None, col_fmt=None if axis == -1 else fmt)
    return _Single(o[f"{orient}_data"].reshape(-1), o[f"{orient}_scale"].reshape(-1), fmt)


def grouped_dequantize_fn(gq):
    return jax_fp4.grouped_dequantize(gq, jnp.bfloat16)


def loop_dequantize_fn(qs):
    return tuple(jax_fp4.dequantize(q, jnp.bfloat16) for q in qs)


def check_groups(v: Variant, grouped, loop, sizes, k) -> bool:
    """Every non-empty group of the grouped outputs equals the loop's single-tensor quantize (data and scales)."""
    ok, i = True, 0
    off = np.concatenate([[0], np.cumsum(sizes)]) * k
    for g in range(len(sizes)):
        if sizes[g] == 0:
            continue
        for gq in grouped:
            q = loop[i]
            i += 1
            bs = gq.fmt.block_size
            ok &= bench.bits_equal(np.asarray(gq.data)[off[g] : off[g + 1]], np.asarray(q.data).reshape(-1))
            ok &= bench.bits_equal(np.asarray(gq.scale)[off[g] // bs : off[g + 1] // bs],
                                   np.asarray(q.scale).reshape(-1))
    return bool(ok)


# ---- one (shape, N, variant) ------------------------------------------------------------------------------------
def run_variant(v, bufs, sizes, timing, check):
    """(grouped s, grouped bytes, loop s, loop bytes, bit-exact or None) of one variant."""
    n, k = len(sizes), bufs[0].shape[1]
    dsizes = jax.device_put(jnp.asarray(sizes))
    amaxes = [given_amaxes(v, b, dsizes) if v.kernel else () for b in bufs]
    auxs = [(dsizes, *a) for a in amaxes]
    qfn, lfn = grouped_quantize_fn(v), loop_quantize_fn(v, sizes)
    if not v.dequantize:
        if bench.kernels_missing(qfn, (bufs[0], *auxs[0]), ["jf4_grouped_quantize"]):
            print(f"warning: {v.id}: no jf4_grouped_quantize custom call (reference path timed)")
        t, got = bench.time_over_buffers(qfn, bufs, **timing, auxs=auxs, keep=check)
        t_loop, want = bench.time_over_buffers(lfn, bufs, **timing, auxs=amaxes, keep=check)
        x_bytes = bench.tree_bytes(bufs[0])
        gb = x_bytes + bench.tree_bytes(jax.eval_shape(qfn, bufs[0], *auxs[0]))
        lb = x_bytes + bench.tree_bytes(jax.eval_shape(lfn, bufs[0], *amaxes[0]))
        exact = bench.bit_exact_check(f"{v.id} N={n}", check_groups, v, got[0], want[0], sizes, k) if check else None
        return t, gb, t_loop, lb, exact
    gqs = [jax.block_until_ready(jax.jit(qfn)(b, dsizes)[0]) for b in bufs]
    lqs = [jax.block_until_ready(jax.jit(lfn)(b)) for b in bufs]
    if bench.kernels_missing(grouped_dequantize_fn, (gqs[0],), ["jf4_grouped_dequantize"]):
        print(f"warning: {v.id}: no jf4_grouped_dequantize custom call (reference path timed)")
    t, got = bench.time_over_buffers(grouped_dequantize_fn, gqs, **timing, keep=check)
    t_loop, want = bench.time_over_buffers(loop_dequantize_fn, lqs, **timing, keep=check)
    gb = bench.tree_bytes(gqs[0]) + bench.tree_bytes(jax.eval_shape(grouped_dequantize_fn, gqs[0]))
    lb = bench.tree_bytes(lqs[0]) + bench.tree_bytes(jax.eval_shape(loop_dequantize_fn, lqs[0]))
    exact = None
    if check:
        axis = -1 if v.row is not None else 0

        def same(got, want):
            flat = np.asarray(got).reshape(-1)
            off = np.concatenate([[0], np.cumsum(sizes[sizes > 0])]) * k
            return all(bench.bits_equal(flat[off[i] : off[i + 1]], np.asarray(w).reshape(-1))
                       for i, w in enumerate(want))

        exact = bench.bit_exact_check(f"{v.id} N={n} axis {axis}", same, got[0], want[0])
    return t, gb, t_loop, lb, exact


def main():
    ap = bench.base_parser(__doc__, "grouped", iters=20, repeats=3, variants=True,
                           shapes_help="default | small (1024x512) | comma list of TxK (T % 32 == 0)")
    ap.add_argument("--groups", default="8,64", help="comma list of group counts N")
    args = ap.parse_args()
    shapes = bench.parse_shapes(args.shapes, SHAPES, SMALL_SHAPES)
    variants = bench.parse_variants(args.variants, VARIANTS)
    groups = [int(s) for s in args.groups.split(",")]
    dev = bench.setup_device("'jf4_grouped_quantize' / 'jf4_grouped_dequantize'")
    results = {
        **bench.run_info(dev),
        "method": f"jit over {K} rotated buffers, best of {args.repeats} x <= {args.iters} calls, block_until_ready",
        "copy_GBps": {},
        "group_sizes": {},
        "rows": [],
    }
    print(bench.describe_run(results), flush=True)
    timing = dict(iters=args.iters, repeats=args.repeats)
    rows, t_start = results["rows"], time.perf_counter()
    for si, sname, shape, bufs, copy_gbs in bench.shape_buffers(shapes, results, K, KEY, **timing):
        if shape[0] % ALIGN:
            raise SystemExit(f"shape {shape}: T must be a multiple of {ALIGN}")
        for n in groups:
            sizes = group_sizes(shape[0], n)
            results["group_sizes"][f"{sname} N={n}"] = sizes.tolist()
            print(f"[{sname}] N={n}: sizes {sizes.tolist() if n <= 16 else f'{sizes.min()}..{sizes.max()}'}"
                  f" ({int((sizes == 0).sum())} empty)", flush=True)
            for v in variants:
                t, gb, t_loop, lb, exact = run_variant(v, bufs, sizes, timing, check=si == 0)
                gbs = gb / t / 1e9
                row = {
                    "variant": v.name, "id": v.id, "shape_name": sname, "shape": list(shape), "groups": n,
                    "us": t * 1e6, "bytes": gb, "GBps": gbs, "pct_copy_bw": 100 * gbs / copy_gbs,
                    "loop_us": t_loop * 1e6, "loop_GBps": lb / t_loop / 1e9, "speedup_vs_loop": t_loop / t,
                    "bit_exact_vs_loop": exact,
                }
                rows.append(row)
                print(f"  {v.name:<24} N={n:<3} {row['us']:>9.1f} µs {gbs:>7.0f} GB/s  loop {row['loop_us']:>9.1f} µs "
                      f"(t={time.perf_counter() - t_start:.0f}s)", flush=True)

    bench.print_summary(results, "bytes = inputs read once + all outputs written once (the given amaxes of kernel "
                        "variants included); vs loop = the loop's µs / the grouped call's µs; quantize includes the "
                        "NVFP4 per-group amax pass except in the (kernel) variants")
    bench.print_table(
        [("variant", "<24"), ("shape", "<22"), ("N", ">3"), ("µs", ">9"), ("GB/s", ">7"), ("% copy", ">7"),
         ("loop µs", ">9"), ("vs loop", ">8"), ("exact", ">5")],
        [(r["variant"], r["shape_name"], str(r["groups"]), f"{r['us']:.1f}", f"{r['GBps']:.0f}",
          f"{r['pct_copy_bw']:.1f}%", f"{r['loop_us']:.1f}", bench.fmt_speedup(r["speedup_vs_loop"]),
          bench.fmt_exact(r["bit_exact_vs_loop"])) for r in rows])
    bench.finish_run(results, args.out, t_start)


if __name__ == "__main__":
    main()
