"""Tensor amax benchmark (GPU): the jf4_amax CUDA kernel vs the jitted reference and jnp.max(jnp.abs(x)).

For each shape (bf16) it reports µs per amax, GB/s over the bytes read, and % of the device-to-device copy
bandwidth measured in the same run (jit(jnp.copy) of a same-size bf16 array, read + write bytes).

Timing: every function is jitted over K rotated input buffers (one call runs the op on each of them, so one Python
dispatch covers K kernels and no input stays in L2); after warm-up, `iters` calls are enqueued back to back and the
wall time until `jax.block_until_ready` is divided by iters * K. The best of `repeats` runs is reported.

Usage: python benchmarks/amax.py [--out benchmarks/results/amax.json] [--iters 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4._src import ffi
from jax_fp4._src.primitives.amax import tensor_amax
from jax_fp4.reference.amax import amax as reference_amax

SHAPES = {
    "square 8192x8192": (8192, 8192),
    "llama3-8b mlp down-proj input 16384x14336": (16384, 14336),
}
K = 4  # rotated buffers per call


def _over_buffers(fn):
    return jax.jit(lambda *xs: tuple(fn(x) for x in xs))


def time_fn(fn, bufs, iters, repeats) -> float:
    """Best seconds per single-buffer application of fn."""
    f = _over_buffers(fn)
    jax.block_until_ready(f(*bufs))  # compile + warm-up
    jax.block_until_ready(f(*bufs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(*bufs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (iters * len(bufs)))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "amax.json"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"warning: default device is {dev} (not a GPU); numbers are not representative")
    if not ffi.HAS_CUDA_KERNELS:
        print(f"warning: CUDA extension missing ({ffi.import_error()}); 'jf4_amax' runs the reference")

    impls = {
        "jf4_amax (CUDA FFI)": tensor_amax,
        "reference (jit)": reference_amax,
        "jnp.max(jnp.abs(x))": lambda x: jnp.max(jnp.abs(x)),
    }
    results = {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "has_cuda_kernels": ffi.HAS_CUDA_KERNELS,
        "method": f"jit over {K} rotated buffers, best of {args.repeats} x {args.iters} calls, block_until_ready",
        "shapes": {},
    }
    rows = []
    key = jax.random.key(0)
    for name, shape in SHAPES.items():
        keys = jax.random.split(key, K)
        bufs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys]
        jax.block_until_ready(bufs)
        nbytes = int(np.prod(shape)) * 2

        # Check the kernel before timing it (bit-exact vs the reference).
        got = np.asarray(jax.jit(tensor_amax)(bufs[0])).view(np.uint32)
        want = np.asarray(jax.jit(reference_amax)(bufs[0])).view(np.uint32)
        assert got == want, f"{name}: kernel 0x{int(got):08x} != reference 0x{int(want):08x}"
        if ffi.HAS_CUDA_KERNELS and dev.platform == "gpu":
            assert "jf4_amax" in jax.jit(tensor_amax).lower(bufs[0]).as_text()

        t_copy = time_fn(jnp.copy, bufs, args.iters, args.repeats)
        copy_gbs = 2 * nbytes / t_copy / 1e9
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
            t = time_fn(fn, bufs, args.iters, args.repeats)
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

    print(f"\ndevice: {results['device']}  jax {results['jax']}  ({results['method']})")
    hdr = f"{'shape':<44} {'impl':<30} {'µs':>10} {'GB/s':>9} {'% copy BW':>10} {'jf4 speed-up':>13}"
    print(hdr)
    print("-" * len(hdr))
    for name, iname, us, gbs, pct, sp in rows:
        sp_s = "" if sp is None else f"{sp:.2f}x"
        print(f"{name:<44} {iname:<30} {us:>10.1f} {gbs:>9.0f} {pct:>9.1f}% {sp_s:>13}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
