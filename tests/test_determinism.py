"""jax_fp4.determinism: the compiler options, the attention choice, the bit-exact checksum.

* `compiler_options` gives XLA's deterministic-ops option (and {} when off), rejects a non-bool; `jit` compiles with
  it (on the CPU, where it changes nothing, the same bits as plain `jax.jit`) and merges given options;
* `attention_implementation` takes XLA's attention under determinism, cuDNN's only on a GPU backend otherwise;
* `checksum` tells trees apart by a single bit (signed zero, a NaN payload, a dtype, a shape, a key) and agrees for
  equal trees;
* GPU (`gpu` marker): a float32 scatter-add with colliding indices (an embedding's gradient) compiled with
  `compiler_options()` gives the same bits on every run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp4 import determinism


def test_compiler_options():
    assert determinism.compiler_options() == {"xla_gpu_deterministic_ops": True}
    assert determinism.compiler_options(False) == {}
    determinism.compiler_options()["x"] = 1  # a copy: the module's dict is unchanged
    assert determinism.COMPILER_OPTIONS == {"xla_gpu_deterministic_ops": True}
    with pytest.raises(TypeError, match="deterministic must be a bool, got str 'yes'"):
        determinism.compiler_options("yes")


def test_jit_compiles_with_the_option(rng):
    x = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    f = lambda a: jnp.tanh(a @ a.T).sum(axis=0)  # noqa: E731
    det = determinism.jit(f)
    np.testing.assert_array_equal(np.asarray(det(x)), np.asarray(jax.jit(f)(x)))
    # the given compiler options are kept beside the deterministic one
    both = determinism.jit(f, compiler_options={"xla_cpu_enable_fast_math": False})
    np.testing.assert_array_equal(np.asarray(both(x)), np.asarray(det(x)))
    assert determinism.jit(f, deterministic=False, donate_argnums=())(x).shape == (64,)


def test_attention_implementation():
    assert determinism.attention_implementation(True) == "xla"
    assert determinism.attention_implementation(True, "gpu") == "xla"
    assert determinism.attention_implementation(False, "gpu") == "cudnn"
    assert determinism.attention_implementation(False, "cpu") is None


def test_checksum_is_bit_exact(rng):
    a = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), "b": jnp.zeros((4,), jnp.bfloat16),
         "k": jax.random.key(3)}
    same = jax.tree.map(lambda v: v.copy(), a)
    assert determinism.checksum(a) == determinism.checksum(same)
    flipped = dict(a, w=a["w"].at[3, 1].set(jnp.nextafter(a["w"][3, 1], jnp.inf)))
    signed = dict(a, b=-a["b"])  # -0.0 == 0.0 but not the same bits
    nan_payload = [jnp.asarray(np.array([0x7FC00000], np.uint32).view(np.float32)),
                   jnp.asarray(np.array([0x7FC00001], np.uint32).view(np.float32))]
    other_key = dict(a, k=jax.random.key(4))
    recast = dict(a, b=a["b"].astype(jnp.float16))
    reshaped = dict(a, w=a["w"].reshape(4, 8))
    sums = {determinism.checksum(t) for t in (a, flipped, signed, other_key, recast, reshaped)}
    assert len(sums) == 6
    assert determinism.checksum(nan_payload[0]) != determinism.checksum(nan_payload[1])


@pytest.mark.gpu
def test_gpu_scatter_add_is_reproducible(rng):
    n, rows, width = 1 << 16, 64, 256
    idx = jnp.asarray(rng.integers(0, rows, n), jnp.int32)
    upd = jnp.asarray(rng.standard_normal((n, width)), jnp.float32)

    def f(i, u):
        return jnp.zeros((rows, width), jnp.float32).at[i].add(u)

    det = jax.jit(f, compiler_options=determinism.compiler_options())
    first = np.asarray(det(idx, upd))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(det(idx, upd)).view(np.uint32), first.view(np.uint32))
    np.testing.assert_allclose(first, np.asarray(jax.ops.segment_sum(upd, idx, rows)), rtol=1e-4, atol=1e-3)
