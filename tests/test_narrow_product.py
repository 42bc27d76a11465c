"""`narrow_product` (jax_fp4/_src/emulation/sharded.py): the bfloat16-output dot that `jax_fp4.dense`
runs on cuBLAS for unscaled exact operands keeps the default float32 cross-shard sum under a mesh.

On 4 forced CPU devices (one subprocess: XLA_FLAGS must be set before the backend starts), a weight-gradient-shaped
product x[M, K]^T . dy[M, N] with M sharded (data parallel: result replicated, an all-reduce; FSDP: result sharded
along K, a reduce-scatter). The operands are integers of magnitude <= 64 (exact in bfloat16), so every float32
partial sum is exact and the float32 sum is the same in any order, while the bfloat16 result (8 bits of mantissa)
rounds it: the sharded result must equal the unsharded one bit for bit, while rounding each shard's partial product
to bfloat16 first (the rule of XLA's own partitioning of the bfloat16-output dot, computed here in numpy) changes it
somewhere, which shows the comparison can fail. The collectives' dtypes are read from the HLO right after SPMD
partitioning (XLA:CPU widens bfloat16 collectives later): float32 for narrow_product, bfloat16 for the plain dot.
"""

from __future__ import annotations

import textwrap

import pytest
from _cpu_devices import run_results

pytestmark = pytest.mark.slow  # a multi-device subprocess: full suite only


SCRIPT = textwrap.dedent(
    """
    import glob, json, os, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_fp4._src.emulation.sharded import narrow_product

    DUMP = sys.argv[1]
    WGRAD = (((0,), (0,)), ((), ()))
    M, K, N = 512, 128, 64
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-64, 65, (M, K)), jnp.bfloat16)
    dy = jnp.asarray(rng.integers(-64, 65, (M, N)), jnp.bfloat16)

    def reduction_dtypes(fn, *args):
        before = set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*")))
        compiled = fn.lower(*args).compile()
        new = sorted(set(glob.glob(os.path.join(DUMP, "*after_spmd-partitioning*"))) - before)
        found = re.findall(r"= (\\w+)\\[[\\d,]*\\][^ ]* (all-reduce|reduce-scatter)\\(", open(new[-1]).read())
        return sorted({f"{op} {dt}" for dt, op in found}), compiled

    narrow = lambda a, b: narrow_product(a, b, WGRAD, jnp.bfloat16)
    plain = lambda a, b: jax.lax.dot_general(a, b, WGRAD, preferred_element_type=jnp.bfloat16)
    narrow_output = lambda a, b: narrow_product(a, b, WGRAD, jnp.bfloat16, jnp.bfloat16)  # reduce_dtype="output"
    one = np.asarray(jax.jit(narrow)(x, dy))
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    # the rule XLA's partitioning of a bfloat16-output dot follows on a GPU: each shard's partial rounded first
    partials = [np.asarray(jnp.asarray(x64[s].T @ dy64[s], jnp.float32).astype(jnp.bfloat16), np.float64)
                for s in np.split(np.arange(M), 4)]
    rounded_first = np.asarray(jnp.asarray(sum(partials), jnp.float32).astype(jnp.bfloat16))
    print("RESULT", json.dumps({"case": "unsharded", "equal_plain": bool(np.array_equal(one, jax.jit(plain)(x, dy))),
                                "rounds": bool(np.any(np.asarray(one, np.float64) != x64.T @ dy64)),
                                "partials_rounded_differ": bool(not np.array_equal(one, rounded_first))}))
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    for case, out in (("all-reduce", NamedSharding(mesh, P())), ("reduce-scatter", rows)):
        for name, fn in (("narrow", narrow), ("plain", plain), ("narrow output", narrow_output)):
            f = jax.jit(fn, in_shardings=(rows, rows), out_shardings=out)
            dtypes, compiled = reduction_dtypes(f, x, dy)
            y = np.asarray(compiled(x, dy))
            print("RESULT", json.dumps({"case": case, "fn": name, "reductions": dtypes,
                                        "equal": bool(np.array_equal(y, one))}), flush=True)
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo")
    return {(r["case"], r.get("fn")): r for r in run_results(SCRIPT, 4, args=(dump,), dump=dump)}


def test_unsharded_is_the_narrow_dot(results):
    r = results[("unsharded", None)]
    assert r["equal_plain"]
    # the bfloat16 result rounds the exact sum, and rounding the 4 shards' partial sums first changes it: the
    # sharded comparisons below can fail
    assert r["rounds"] and r["partials_rounded_differ"]


@pytest.mark.parametrize("case", ["all-reduce", "reduce-scatter"])
def test_sharded_contraction_sums_float32(results, case):
    r = results[(case, "narrow")]
    assert r["reductions"] == [f"{case} f32"], r
    assert r["equal"], r


@pytest.mark.parametrize("fn", ["plain", "narrow output"])
@pytest.mark.parametrize("case", ["all-reduce", "reduce-scatter"])
def test_bfloat16_reductions(results, case, fn):
    # plain: what narrow_product replaces, XLA partitions the bfloat16-output dot into bfloat16 partial sums (XLA:CPU
    # then widens that collective and may drop the rounding, so only the partitioned HLO shows a GPU's rule);
    # narrow output: sum_dtype=bfloat16 (reduce_dtype="output") moves the bfloat16 step's bytes on purpose
    r = results[(case, fn)]
    assert r["reductions"] and all(d.endswith(" bf16") for d in r["reductions"]), r
    if fn == "narrow output" and case == "reduce-scatter":
        assert r["reductions"] == ["reduce-scatter bf16"], r


@pytest.mark.parametrize("sum_dtype", ["float32", "bfloat16"])
def test_under_vmap_each_batch_element_is_its_product(sum_dtype):
    """jax_fp4.dot_general's batch axes vmap the GEMM: the batched rule gives each element's float32 product cast
    once (exactly summable integers, so every order agrees with the narrow dot)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_fp4._src.emulation.sharded import narrow_product

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(-64, 65, (3, 64, 32)), jnp.bfloat16)
    dy = jnp.asarray(rng.integers(-64, 65, (3, 64, 16)), jnp.bfloat16)
    dn = (((0,), (0,)), ((), ()))
    got = jax.jit(jax.vmap(lambda a, b: narrow_product(a, b, dn, jnp.bfloat16, jnp.dtype(sum_dtype))))(x, dy)
    assert got.dtype == jnp.bfloat16 and got.shape == (3, 32, 16)
    for i in range(3):
        want = jax.lax.dot_general(x[i], dy[i], dn, preferred_element_type=jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))
