"""Tensor amax benchmark (GPU): the jf4_amax CUDA kernel vs the jitted reference and jnp.max(jnp.abs(x)).

For each shape (bf16) it reports µs per amax, GB/s over the bytes read, and % of the device-to-device copy
bandwidth measured in the same run (jit(jnp.copy) of a same-size bf16 array, read + write bytes).

Timing: every function is jitted over K rotated input buffers (one call runs the op on each of them, so one Python
dispatch covers K kernels and no input stays in L2); after warm-up, `iters` calls are enqueued back to back and the
wall time until `jax.block_until_ready` is divided by iters * K. The best of `repeats` runs is reported.

Usage: python benchmarks/amax.py [--out benchmarks/results/amax.json] [--iters 50] [--repeats 5]
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4.reference.amax import amax as reference_amax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_common.py, also under python -P
import _common as bench  # noqa: E402

SHAPES = {
    "square 8192x8192": (8192, 8192),
    "llama3-8b mlp down-proj input 16384x14336": (16384, 14336),
}
K = 4  # rotated buffers per call


def main():
    args = bench.base_parser(__doc__, "amax", iters=50, repeats=5).parse_args()
    timing = dict(iters=args.iters, repeats=args.repeats, budget_s=None)  # exactly `iters` calls per repeat
    dev = bench.setup_device("'jf4_amax'")

    impls = {
        "jf4_amax (CUDA FFI)": tensor_amax,
        "reference (jit)": reference_amax,
        "jnp.max(jnp.abs(x))": lambda x: jnp.max(jnp.abs(x)),
    }
    results = {
        **bench.run_info(dev),
        "method": f"jit over {K} rotated buffers, best of {args.repeats} x {args.iters} calls, block_until_ready",
        "shapes": {},
    }
    rows = []
    for name, shape in SHAPES.items():
        bufs = bench.bf16_buffers(shape, K, jax.random.key(0))
        nbytes = int(np.prod(shape)) * 2

        # Check the kernel before timing it (bit-exact vs the reference).
        got = np.asarray(jax.jit(tensor_amax)(bufs[0])).view(np.uint32)
        want = np.asarray(jax.jit(reference_amax)(bufs[0])).view(np.uint32)
        assert got == want, f"{name}: kernel 0x{int(got):08x} != reference 0x{int(want):08x}"
        assert not bench.kernels_missing(tensor_amax, bufs[:1], ["jf4_amax"])

        t_copy, copy_gbs = bench.copy_bandwidth(bufs, **timing)
        entry = {
            "shape": list(shape),
            "dtype": "bfloat16",
            "bytes_read": nbytes,
            "copy": {"us": t_copy * 1e6, "GB/s": copy_gbs},
            "impls": {},
        }
        rows.append((name, "D2D copy (jit jnp.copy, R+W)", t_copy * 1e6, copy_gbs, 100.0, None))
        times = {}
        for iname, fn in impls.items():
            t, _ = bench.time_over_buffers(fn, bufs, **timing)
            times[iname] = t
            gbs = nbytes / t / 1e9
            entry["impls"][iname] = {"us": t * 1e6, "GB/s": gbs, "pct_of_copy_bw": 100 * gbs / copy_gbs}
        t_k = times["jf4_amax (CUDA FFI)"]
        for iname, t in times.items():
            e = entry["impls"][iname]
            e["kernel_speedup"] = t / t_k
            rows.append((name, iname, e["us"], e["GB/s"], e["pct_of_copy_bw"], t / t_k))
        results["shapes"][name] = entry
        del bufs

    print("\n" + bench.describe_run(results))
    bench.print_table(
        [("shape", "<44"), ("impl", "<30"), ("µs", ">10"), ("GB/s", ">9"), ("% copy BW", ">10"),
         ("jf4 speed-up", ">13")],
        [(name, iname, f"{us:.1f}", f"{gbs:.0f}", f"{pct:.1f}%", bench.fmt_speedup(sp, ".2f", ""))
         for name, iname, us, gbs, pct, sp in rows])
    print()
    bench.write_results(results, args.out)


if __name__ == "__main__":
    main()
