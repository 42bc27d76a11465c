"""Quantize a real weight-like matrix to NVFP4 and MXFP8, dequantize it, and report the error and the bytes.

Run: python examples/quantize_roundtrip.py
"""

import jax
import jax.numpy as jnp

import jax_fp4


def main():
    # A weight matrix with a few outlier columns, as LLM projections have.
    key = jax.random.key(0)
    w = jax.random.normal(key, (1024, 4096), jnp.float32) * 0.02
    w = w.at[:, ::512].multiply(40.0).astype(jnp.bfloat16)

    formats = {
        "NVFP4": jax_fp4.NVFP4(),
        "NVFP4 2D": jax_fp4.NVFP4(scaling_2d=True),
        "NVFP4 1x64": jax_fp4.NVFP4(local_1x64=True),
        "MXFP8 E4M3": jax_fp4.MXFP8(),
        "MXFP8 E5M2": jax_fp4.MXFP8(element="e5m2"),
    }
    print(f"{'format':12s} {'rel. error':>10s} {'bits/value':>10s}")
    for name, fmt in formats.items():
        q = jax.jit(lambda x, fmt=fmt: jax_fp4.quantize(x, fmt))(w)
        w_hat = jax_fp4.dequantize(q, jnp.float32)
        err = jnp.linalg.norm(w_hat - w.astype(jnp.float32)) / jnp.linalg.norm(w.astype(jnp.float32))
        bits = jnp.finfo(q.data.dtype).bits * q.data.size + 8 * q.scale.size  # codes + block scales
        bits += sum(32 * a.size for a in (q.amax, q.window_amax) if a is not None)  # fp32 tensor / window amaxes
        print(f"{name:12s} {float(err):10.4f} {bits / w.size:10.3f}")


if __name__ == "__main__":
    main()
