"""Sharding rules of the grouped primitives (jf4_grouped_quantize / jf4_grouped_dequantize), on 8 forced CPU devices.

The grouped row axis is gathered; K is parallel for MXFP8 quantize and for MXFP8 / NVFP4 rowwise dequantize of
SAME_BOTH_DIMS / VARYING_FIRST_DIM buffers; NVFP4 quantize (the per-group amax feeds the encoding inside the fused
call) runs on a gathered x (partitioning.py docstring). Every sharded result equals the unsharded one bit for bit
(dbias within the fp32 summation bound); the K-parallel cases compile without an all-gather of x (bf16). Inside
shard_map each shard's call equals the K slice of the unsharded result (MXFP8) or the quantize of its own slice
(NVFP4, whose tensor amax is the slice's).

XLA_FLAGS must be set before the backend starts, so the checks run in a subprocess (tests/test_sharding.py).
"""

from __future__ import annotations

import re
import textwrap

from test_sharding import _run

SCRIPT = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_fp4
    from jax_fp4.reference import codes

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.bfloat16)
    gs = jnp.array([64, 32, 96, 32], jnp.int32)  # traced (a jit argument); rows 224..255 are padding
    GATHER = re.compile(r"= (\\w+)\\[([0-9,]*)\\]\\S* all-gather\\(")

    def gathers_x(hlo):  # an all-gather of x (bf16, or the reference's float32 copy) or of anything as large
        return any(t in ("bf16", "f32") and np.prod([int(d) for d in dims.split(",") if d]) >= x.size
                   for t, dims in GATHER.findall(hlo))
    COLLECTIVE = re.compile(r"all-gather|all-to-all|collective-permute")

    def bits(a):
        a = jnp.asarray(a)
        if a.dtype.itemsize == 1 or a.dtype.name.startswith("float4"):
            return np.asarray(codes.from_dtype(a)).reshape(-1)
        return np.asarray(a).reshape(-1).view(np.uint8)

    def same(r, g):
        return all(np.array_equal(bits(a), bits(b)) for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(g),
                                                                      strict=True))

    def rc(row, col, **kw):
        return lambda x, gs: jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, row, col, **kw)[:2]

    quantize = {  # name: (f, K-parallel)
        "mxfp8 row+col": (rc(M(), M()), True),
        "mxfp8 col e5m2": (lambda x, gs: jax_fp4.grouped_quantize(x, gs, M(element="e5m2"), axis=0), True),
        "mxfp8 row, SAME_BOTH_DIMS": (lambda x, gs: jax_fp4.grouped_quantize(x, 4, M()), True),
        "nvfp4 row": (lambda x, gs: jax_fp4.grouped_quantize(x, gs, N()), False),
        "nvfp4 rht row + col": (rc(N(rht=True), N()), False),
        "nvfp4 sr col": (lambda x, gs: jax_fp4.grouped_quantize(x, gs, N(stochastic_rounding=True), axis=0,
                                                                key=jax.random.key(3)), False),
    }
    bad = []
    for spec in (P("data", "model"), P(None, ("data", "model"))):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        for name, (f, kpar) in quantize.items():
            f = jax.jit(f)
            if not same(f(x, gs), f(xs, gs)):
                bad.append((str(spec), name))
            if kpar and gathers_x(f.lower(xs, gs).compile().as_text()):
                bad.append((str(spec), name, "gathers x"))
        # dbias [N, K] comes out K-sharded; within the fp32 bound of any summation order.
        db = jax.jit(lambda x, gs: jax_fp4.grouped_quantize_rowwise_columnwise(x, gs, M(), None, dbias=True)[2])
        got = db(xs, gs)
        x64 = np.asarray(x, np.float64)
        for g, (a, b) in enumerate(((0, 64), (64, 96), (96, 192), (192, 224))):
            exact, bound = x64[a:b].sum(0), (b - a) * 2.0**-24 * np.abs(x64[a:b]).sum(0)
            if not np.all(np.abs(np.asarray(got[g], np.float64) - exact) <= bound):
                bad.append((str(spec), "dbias", g))
        if tuple(got.sharding.spec) != (None, spec[1]):
            bad.append((str(spec), "dbias sharding", got.sharding.spec))

    # Dequantize with a K-sharded output: each shard reads its K slice of the (replicated) buffers, no collective.
    out = NamedSharding(mesh, P(None, "model"))
    for name, fmt, axis in (("mxfp8 row", M(), -1), ("mxfp8 col", M(), 0), ("nvfp4 row", N(), -1),
                            ("nvfp4 rht row", N(rht=True), -1), ("nvfp4 col (gathered)", N(), 0)):
        q = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, fmt, axis=axis))(x, gs)
        f = jax.jit(lambda q: jax_fp4.grouped_dequantize(q, jnp.bfloat16))
        fs = jax.jit(lambda q: jax_fp4.grouped_dequantize(q, jnp.bfloat16), out_shardings=out)
        got = fs(q)
        if not same(f(q), got) or got.sharding.spec != out.spec:
            bad.append(("dequantize", name))
        if "gathered" not in name and COLLECTIVE.search(fs.lower(q).compile().as_text()):
            bad.append(("dequantize", name, "collective"))
    # VARYING_LAST_DIM (the primitive does not know the representation: the traced whole-buffer branch).
    xl, ld = x[:64], jnp.array([64, 128, 32], jnp.int32)
    q = jax.jit(lambda x, ld: jax_fp4.grouped_quantize(x, None, M(), last_dims=ld))(xl, ld)
    f = jax.jit(lambda q: jax_fp4.grouped_dequantize(q))
    if not same(f(q), jax.jit(lambda q: jax_fp4.grouped_dequantize(q), out_shardings=out)(q)):
        bad.append(("dequantize", "VARYING_LAST_DIM"))

    # shard_map: each shard quantizes its own K slice with the same (traced) group sizes.
    def smap(f, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=out_specs))

    kl = 128
    views = lambda q, ax: (bits(q.data).reshape(256, 256), bits(q.scale).reshape((8, 256) if ax == 0 else (256, 8)))
    for ax in (-1, 0):
        ref = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, M(), axis=ax))(x, gs)
        sm = smap(lambda x, gs: jax_fp4.grouped_quantize(x, gs, M(), axis=ax), P("model"))(x, gs)
        d, s = views(ref, ax)
        for j in range(2):
            sd, ss = bits(sm.data).reshape(2, -1)[j], bits(sm.scale).reshape(2, -1)[j]
            w = s.shape[1] // 2
            if not (np.array_equal(d[:, j * kl : (j + 1) * kl].reshape(-1), sd)
                    and np.array_equal(s[:, j * w : (j + 1) * w].reshape(-1), ss)):
                bad.append(("shard_map quantize mxfp8", ax, j))
        # and the dequantize of each shard's buffers is the K slice of the unsharded dequantize
        dq = smap(lambda x, gs: jax_fp4.grouped_dequantize(jax_fp4.grouped_quantize(x, gs, M(), axis=ax)),
                  P(None, "model"))(x, gs)
        if not same(jax_fp4.grouped_dequantize(ref), dq):
            bad.append(("shard_map dequantize mxfp8", ax))
    # NVFP4: the shard's tensor amax is its slice's, so each shard equals the quantize of its slice.
    sm = smap(lambda x, gs: jax_fp4.grouped_quantize(x, gs, N()).data, P("model"))(x, gs)
    for j in range(2):
        own = jax.jit(lambda x, gs: jax_fp4.grouped_quantize(x, gs, N()).data)(x[:, j * kl : (j + 1) * kl], gs)
        if not same(own, sm[j * kl * 256 : (j + 1) * kl * 256]):
            bad.append(("shard_map nvfp4", j))
    print("BAD", bad)
    """
)


def test_grouped_sharded_equals_unsharded():
    """grouped quantize / dequantize under jit with NamedSharding inputs and inside shard_map (module docstring)."""
    _run(SCRIPT)


def test_gather_pattern():
    """The HLO pattern the script uses to find an all-gather of x (dtype and dims)."""
    pat = re.compile(r"= (\w+)\[([0-9,]*)\]\S* all-gather\(")
    assert pat.findall("%all-gather = bf16[256,256]{0,1} all-gather(%p), channel_id=1") == [("bf16", "256,256")]
    assert pat.findall("%all-gather.2 = f32[65536]{0} all-gather(%p)") == [("f32", "65536")]
