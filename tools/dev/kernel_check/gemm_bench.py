"""Throughput of the Hopper block-scaled GEMM kernel (`jf4_gemm`, called directly) against a bfloat16 `jnp.dot`
(cuBLAS) on the same shapes in the same run.

  python3 -P tools/dev/kernel_check/gemm_bench.py [--shapes 8192x8192x8192,16384x4096x4096] [--iters 20]
      [--pairs "nvfp4 x nvfp4,mxfp8 e4m3 x e4m3"]

Per shape (M x N x K; out[M, N] = a[M, K] . b[N, K]^T, bfloat16 output) and pairing, the median time of `--iters`
runs of one jitted call (after a warm-up), TFLOP/s = 2 M N K / time, and the ratio to the bf16 dot. Operands are
quantized once on the GPU before timing (the quantize pass is not timed). Needs a compute capability 9.x GPU.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src.ffi_codes import GemmFlag, Kind

PAIRS = {
    "nvfp4 x nvfp4": (NVFP4(), NVFP4()),
    "mxfp8 e4m3 x e4m3": (MXFP8(), MXFP8()),
    "nvfp4 1x64 x 1x64": (NVFP4(local_1x64=True), NVFP4(local_1x64=True)),
    "nvfp4 x mxfp8": (NVFP4(), MXFP8()),
}


def _kind(fmt) -> int:
    if isinstance(fmt, NVFP4):
        return int(Kind.NVFP4)
    return int(Kind.MXFP8_E5M2 if fmt.element == "e5m2" else Kind.MXFP8_E4M3)


def _aux(q):
    if q.fmt.local_1x64:
        return q.window_amax
    return q.amax if q.amax is not None else jnp.zeros((0,), jnp.float32)


def gemm_call(qa, qb, emit_amax=True):
    flags = GemmFlag.EMIT_AMAX if emit_amax else 0
    if qa.fmt.local_1x64:
        flags |= GemmFlag.A_LOCAL_1X64 | GemmFlag.B_LOCAL_1X64
    shapes = (jax.ShapeDtypeStruct((qa.shape[0], qb.shape[0]), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.float32))
    return jax.ffi.ffi_call("jf4_gemm", shapes)(qa.data, qa.scale, _aux(qa), qb.data, qb.scale, _aux(qb),
                                                jnp.zeros((0,), jnp.float32), a_kind=np.int32(_kind(qa.fmt)),
                                                b_kind=np.int32(_kind(qb.fmt)), flags=np.int32(int(flags)))


def timed(fn, *args, iters: int) -> float:
    """Median seconds of one call of jitted fn(*args) over `iters` runs (each synchronized)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x8192x8192,16384x4096x4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated pairing names (default: all)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} (compute capability {getattr(dev, 'compute_capability', '?')}), jax "
          f"{jax.__version__}")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (n, k), jnp.bfloat16)
        flops = 2.0 * m * n * k
        dot = jax.jit(lambda x, y: jnp.dot(x, y.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        t_bf16 = timed(dot, a, b, iters=args.iters)
        print(f"{m}x{n}x{k}  bf16 jnp.dot: {t_bf16 * 1e3:8.3f} ms  {flops / t_bf16 / 1e12:7.1f} TFLOP/s")
        for name in args.pairs.split(","):
            fa, fb = PAIRS[name]
            qa = jax.block_until_ready(jax.jit(lambda x, f=fa: jax_fp4.quantize(x, f))(a))
            qb = jax.block_until_ready(jax.jit(lambda x, f=fb: jax_fp4.quantize(x, f))(b))
            t = timed(jax.jit(gemm_call), qa, qb, iters=args.iters)
            print(f"{m}x{n}x{k}  {name:18s}: {t * 1e3:8.3f} ms  {flops / t / 1e12:7.1f} TFLOP/s  "
                  f"{t_bf16 / t:5.3f}x bf16")


if __name__ == "__main__":
    main()
