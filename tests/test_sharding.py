"""Sharding rules (custom_partitioning + Shardy): sharded results equal unsharded ones, on 8 forced CPU devices.

Covers quantize / amax (SCRIPT) and dequantize / swizzle / unswizzle (DEQUANTIZE_SCRIPT).

XLA_FLAGS must be set before the backend starts, so the checks run in a subprocess. The amax and quantize outputs
must match bit for bit; dbias (an fp32 sum whose reduction order XLA may change with the sharding) within the
fp32 summation bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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

DEQUANTIZE_SCRIPT = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_fp4

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 256)), jnp.bfloat16)
    COLLECTIVE = re.compile(r"all-gather|all-to-all|collective-permute")

    def bits(a):
        a = np.asarray(a)
        return a.reshape(-1).view(f"u{a.dtype.itemsize}")

    # (quantize, then dequantize / swizzle in a jit of its own: on jax 0.12 XLA:CPU compiles the two references
    # fused into one module for minutes.)
    def q(fmt, axis, layout="compact"):
        return jax.jit(lambda x: jax_fp4.quantize(x, fmt, axis=axis, scale_layout=layout))

    def dq(dtype=jnp.bfloat16):
        return jax.jit(lambda q: jax_fp4.dequantize(q, dtype))

    cases = {  # quantize a sharded x, then dequantize (or change the scale layout of) the sharded result
        "nvfp4 row": (q(N(), -1), dq()),
        "nvfp4 col (transposed output)": (q(N(), 0), dq(jnp.float32)),
        "nvfp4 rht col": (q(N(rht=True), 0), dq()),
        "nvfp4 1x64 row": (q(N(local_1x64=True), -1), dq(jnp.float16)),
        "mxfp8 row": (q(M(), -1), dq()),
        "mxfp8 col": (q(M(element="e5m2"), 0), dq()),
        "nvfp4 row swizzled": (q(N(), -1, "swizzled"), dq()),
        "mxfp8 col swizzled": (q(M(), 0, "swizzled"), dq()),
        "swizzle_scales": (q(N(), -1), jax.jit(lambda q: jax_fp4.swizzle_scales(q).scale)),
        "unswizzle_scales": (q(M(), 0, "swizzled"), jax.jit(lambda q: jax_fp4.unswizzle_scales(q).scale)),
    }
    bad = []
    for spec in (P("data", None), P(None, "model"), P("data", "model")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        for name, (fq, f) in cases.items():
            if not np.array_equal(bits(f(fq(x))), bits(f(fq(xs)))):
                bad.append((str(spec), name))

    # Dequantize alone, the QuantizedArray's leaves sharded like x (NVFP4 columnwise data: like x.T). Compact scales
    # hold whole blocks per shard here, so nothing is gathered and the output keeps x's sharding.
    spec = P("data", "model")
    for name, fmt, axis in (("nvfp4 row", N(), -1), ("nvfp4 col", N(), 0), ("nvfp4 1x64 row", N(local_1x64=True), -1),
                            ("mxfp8 col", M(), 0)):
        q = jax.jit(lambda x: jax_fp4.quantize(x, fmt, axis=axis))(x)
        dspec = P("model", "data") if isinstance(fmt, N) and axis == 0 else spec
        put = lambda a: None if a is None else jax.device_put(a, NamedSharding(mesh, dspec if a.ndim == 2 else P()))
        qs = jax_fp4.QuantizedArray(put(q.data), put(q.scale), put(q.amax), put(q.window_amax), fmt=fmt, axis=q.axis)
        f = jax.jit(lambda q: jax_fp4.dequantize(q, jnp.bfloat16))
        got = f(qs)
        if not np.array_equal(bits(got), bits(f(q))):
            bad.append(("leaves sharded", name))
        if got.sharding.spec != spec:
            bad.append(("leaves sharded", name, "output sharding", got.sharding.spec))
        if COLLECTIVE.search(f.lower(qs).compile().as_text()):
            bad.append(("leaves sharded", name, "collective"))

    # vmap folds the batch into P with one amax per example: the amax operand is sharded with P.
    xb = jax.device_put(x.reshape(8, 64, 256), NamedSharding(mesh, P("data", None, "model")))
    qb = jax.jit(jax.vmap(lambda x: jax_fp4.quantize(x, N(), axis=0)))
    fb = jax.jit(jax.vmap(jax_fp4.dequantize))
    if not np.array_equal(bits(fb(qb(xb))), bits(fb(qb(x.reshape(8, 64, 256))))):
        bad.append(("vmap", "amax per p"))

    # swizzle / unswizzle primitives: leading dims parallel, rows in whole 128-row tiles, else gathered.
    from jax_fp4._src.primitives.swizzle import reference_swizzle, swizzle, unswizzle
    s = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 256, 12)), jnp.uint8)
    for sspec in (P("data", "model", None), P(None, "data", "model"), P(None, "model", None)):
        ss = jax.device_put(s, NamedSharding(mesh, sspec))
        sw = jax.jit(swizzle)(ss)
        if not np.array_equal(np.asarray(sw), np.asarray(reference_swizzle(s))):
            bad.append((str(sspec), "swizzle"))
        if not np.array_equal(np.asarray(jax.jit(lambda a: unswizzle(a, 256, 12))(sw)), np.asarray(s)):
            bad.append((str(sspec), "unswizzle"))
    sw = jax.jit(swizzle)(jax.device_put(s[0], NamedSharding(mesh, P("model", None))))
    if tuple(sw.sharding.spec)[:1] != ("model",):  # 128 rows per shard: stays sharded
        bad.append(("swizzle rows", sw.sharding.spec))
    print("BAD", bad)
    """
)


SR_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_fp4
    from jax_fp4._src.primitives.quantize import quantize_3d
    from jax_fp4.reference import codes, sr

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    SR = jax_fp4.NVFP4(stochastic_rounding=True)
    SR_RHT = jax_fp4.NVFP4(stochastic_rounding=True, rht=True)
    key = jax.random.key(7)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 256)), jnp.float32)
    x3 = jnp.asarray(rng.standard_normal((8, 64, 256)), jnp.bfloat16)

    def bits(a):
        a = jnp.asarray(a)
        if a.dtype.itemsize == 1 or a.dtype.name.startswith("float4"):
            return np.asarray(codes.from_dtype(a))
        return np.asarray(a).reshape(-1).view(np.uint8)

    def q3(row_fmt, col_fmt):  # the primitive on x[P, M, K] (rowwise with P > 1 is not reachable from the ops)
        def f(x3):
            amax = jnp.broadcast_to(jnp.max(jnp.abs(x3.astype(jnp.float32))), (x3.shape[0],))
            kr, kc = (sr.philox_key(k) for k in jax.random.split(key))
            o = quantize_3d(x3, amax, amax, kr, kc, row_fmt=row_fmt, col_fmt=col_fmt)
            return o["row_data"], o["row_scale"], o["col_data"], o["col_scale"]
        return f

    cases2 = {  # x[M, K]: M (rows) and K (columns) sharded
        "row": lambda x: jax_fp4.quantize(x, SR, key=key),
        "col": lambda x: jax_fp4.quantize(x, SR, axis=0, key=key),
        "row+col rht": lambda x: jax_fp4.quantize_rowwise_columnwise(x, SR, SR_RHT, key=key)[:2],
        "row swizzled": lambda x: jax_fp4.quantize(x, SR, key=key, scale_layout="swizzled"),
    }
    cases3 = {  # x[P, M, K] (P = 8): P, M and K sharded
        "col, P > 1": lambda x: jax_fp4.quantize(x, SR, axis=1, key=key),
        "row+col, P > 1": q3(SR, SR),
    }
    specs2 = (P("data", None), P(None, "model"), P("data", "model"), P(None, ("model", "data")))
    specs3 = (P("data", None, None), P(None, "data", None), P(None, None, "model"), P("model", None, "data"),
              P(("data", "model"), None, None))
    bad = []
    for xa, cases, specs in ((x, cases2, specs2), (x3, cases3, specs3)):
        refs = {name: jax.jit(f)(xa) for name, f in cases.items()}
        for spec in specs:
            xs = jax.device_put(xa, NamedSharding(mesh, spec))
            for name, f in cases.items():
                ref, got = refs[name], jax.jit(f)(xs)
                for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
                    if not np.array_equal(bits(r), bits(g)):
                        bad.append((str(spec), name, "sharded != unsharded"))
                        break
                # The quantize ran per shard (shards hold whole blocks here, so x is not gathered): the codes come
                # out sharded, each shard having drawn its own part of the stream.
                if not any(ax is not None for ax in jax.tree.leaves(got)[0].sharding.spec):
                    bad.append((str(spec), name, "data not sharded"))
    # Different keys still give different codes on the sharded path (the key reaches every shard).
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    a = bits(jax.jit(lambda x: jax_fp4.quantize(x, SR, key=jax.random.key(1)).data)(xs))
    b = bits(jax.jit(lambda x: jax_fp4.quantize(x, SR, key=jax.random.key(2)).data)(xs))
    if np.mean(a != b) < 0.05:
        bad.append(("keys 1 and 2", float(np.mean(a != b))))
    print("BAD", bad)
    """
)


def _run(script):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "BAD []" in r.stdout, r.stdout[-4000:]


def test_sharded_equals_unsharded():
    _run(SCRIPT)


def test_dequantize_and_swizzle_sharded_equal_unsharded():
    _run(DEQUANTIZE_SCRIPT)


@pytest.mark.slow  # a multi-device subprocess (~30 s): the full suite, not the quick tier
def test_stochastic_rounding_sharded_equals_unsharded():
    """NVFP4 stochastic rounding, rowwise and columnwise, x sharded along M, K and P (and two mesh axes on one dim):
    every element draws the byte of its global index, so sharded == unsharded bit for bit, without gathering x."""
    _run(SR_SCRIPT)
