"""Sharding rules (custom_partitioning + Shardy): sharded results equal unsharded ones, on 8 forced CPU devices.

XLA_FLAGS must be set before the backend starts, so the checks run in a subprocess. The amax and quantize outputs
must match bit for bit; dbias (an fp32 sum whose reduction order XLA may change with the sharding) within the
fp32 summation bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_fp4
    from jax_fp4.reference import codes

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 256)), jnp.bfloat16)

    def bits(a):
        a = jnp.asarray(a)
        if a.dtype.itemsize == 1 or a.dtype.name.startswith("float4"):
            return np.asarray(codes.from_dtype(a))
        return np.asarray(a).reshape(-1).view(np.uint8)

    cases = {
        "amax": lambda x: jax_fp4.tensor_amax(x),
        "nvfp4 row": lambda x: jax_fp4.quantize(x, N()),
        "nvfp4 col": lambda x: jax_fp4.quantize(x, N(), axis=0),
        "nvfp4 2d col": lambda x: jax_fp4.quantize(x, N(scaling_2d=True), axis=0),
        "nvfp4 rht col": lambda x: jax_fp4.quantize(x, N(rht=True), axis=0),
        "nvfp4 1x64 row": lambda x: jax_fp4.quantize(x, N(local_1x64=True)),
        "mxfp8 col": lambda x: jax_fp4.quantize(x, M(), axis=0),
        "mxfp8 row+col": lambda x: jax_fp4.quantize_rowwise_columnwise(x, M(), M())[:2],
        "mixed swizzled": lambda x: jax_fp4.quantize_rowwise_columnwise(x, N(), M(), scale_layout="swizzled")[:2],
        "nvfp4 row swizzled": lambda x: jax_fp4.quantize(x, N(), scale_layout="swizzled"),
    }
    bad = []
    for spec in (P("data", None), P(None, "model"), P("data", "model")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        for name, f in cases.items():
            ref, got = jax.jit(f)(x), jax.jit(f)(xs)
            for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
                if not np.array_equal(bits(r), bits(g)):
                    bad.append((str(spec), name))
        # dbias: the bound (M - 1) * 2**-24 * sum|x| per column holds for any summation order.
        db = jax.jit(lambda x: jax_fp4.quantize_rowwise_columnwise(x, M(), M(), dbias=True)[2])(xs)
        exact = np.sum(np.asarray(x, np.float64), axis=0)
        bound = (x.shape[0] - 1) * 2.0**-24 * np.sum(np.abs(np.asarray(x, np.float64)), axis=0)
        if not np.all(np.abs(np.asarray(db, np.float64) - exact) <= bound):
            bad.append((str(spec), "dbias"))
        # Shards hold whole blocks here (512/4 rows, 256/2 columns), so nothing is gathered: outputs keep x's
        # sharding (NVFP4 columnwise data transposed) and the only collective is the amax all-reduce.
        if spec == P("data", "model"):
            for name in ("nvfp4 row", "mxfp8 row+col", "mixed swizzled"):
                hlo = jax.jit(cases[name]).lower(xs).compile().as_text()
                if "all-gather" in hlo and name != "mixed swizzled":
                    bad.append((str(spec), name, "gathers x"))
            row, col, _ = jax.jit(lambda x: jax_fp4.quantize_rowwise_columnwise(x, N(), N()))(xs)
            specs = (row.data.sharding.spec, row.scale.sharding.spec, col.data.sharding.spec)
            if specs != (P("data", "model"), P("data", "model"), P("model", "data")):
                bad.append((str(spec), "output shardings", specs))
    print("BAD", bad)
    """
)


def test_sharded_equals_unsharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-P", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "BAD []" in r.stdout, r.stdout[-4000:]
