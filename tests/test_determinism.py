"""jax_fp4.determinism: the compiler options, the attention choice, the bit-exact checksum.

* `compiler_options` gives XLA's deterministic-ops option (and {} when off), rejects a non-bool; `jit` compiles with
  it (on the CPU, where it changes nothing, the same bits as plain `jax.jit`) and merges given options;
* `attention_implementation` takes XLA's attention under determinism, cuDNN's only on a GPU backend otherwise;
* `distinct_causal_window` gives every call site its own window, and attention with it equals plain causal attention
  bit for bit (values and gradients, XLA's implementation; on a GPU, cuDNN's under deterministic ops, where two
  identical backward graphs do not compile);
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


def test_distinct_causal_window():
    assert [determinism.distinct_causal_window(16, i) for i in range(3)] == [(15, 0), (16, 0), (17, 0)]
    assert determinism.distinct_causal_window(1, 0) == (0, 0)
    for bad in ((0, 0), (16, -1), (16.0, 0), (16, 1.0), (16, None), (16, True)):
        with pytest.raises(ValueError, match="distinct_causal_window: (seq_len|site) must be an int"):
            determinism.distinct_causal_window(*bad)


def _two_attention_layers(implementation, windows):
    """A loss over two attention layers in sequence (q = k = v = h @ w_i), with `windows` their local_window_size."""

    def loss(ws, x):
        h = x
        for w, win in zip(ws, windows, strict=True):
            qkv = (h @ w).reshape(*x.shape[:2], 4, 16)
            h = h + jax.nn.dot_product_attention(qkv, qkv, qkv, is_causal=True, local_window_size=win,
                                                 implementation=implementation).reshape(x.shape)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss)


def _assert_same_bits(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint16 if u.dtype == jnp.bfloat16 else np.uint32),
                                      np.asarray(v).view(np.uint16 if v.dtype == jnp.bfloat16 else np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_distinct_windows_give_plain_causal_attention(rng, dtype):
    t = 24
    ws = [jnp.asarray(rng.standard_normal((64, 64)) * 0.2, dtype) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((3, t, 64)), dtype)
    windows = [determinism.distinct_causal_window(t, i) for i in range(2)]
    plain = jax.jit(_two_attention_layers(None, [None, None]))(ws, x)
    _assert_same_bits(jax.jit(_two_attention_layers(None, windows))(ws, x), plain)
    # a window one position short of the sequence does mask: the check can tell
    short = jax.jit(_two_attention_layers(None, [(t - 2, 0)] * 2))(ws, x)
    assert not np.array_equal(np.asarray(short[0]), np.asarray(plain[0]))


@pytest.mark.gpu
def test_distinct_windows_compile_cudnn_attention_under_deterministic_ops(rng):
    """Two identical backward cuDNN attention graphs abort XLA's compile under deterministic ops; distinct windows
    compile, give the same bits on every run and equal plain causal attention (one layer, where that compiles)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 512
    ws = [jnp.asarray(rng.standard_normal((512, 512)) * 0.05, jnp.bfloat16) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((4, t, 512)), jnp.bfloat16)

    def layers(windows):
        def loss(p, h):
            for w, win in zip(p, windows, strict=True):
                qkv = (h @ w).reshape(4, t, 8, 64)
                h = h + jax.nn.dot_product_attention(qkv, qkv, qkv, is_causal=True, local_window_size=win,
                                                     implementation="cudnn").reshape(h.shape)
            return jnp.mean(h.astype(jnp.float32) ** 2)

        return determinism.jit(jax.value_and_grad(loss))

    two = layers([determinism.distinct_causal_window(t, i) for i in range(2)])
    first = two(ws, x)
    for _ in range(2):
        _assert_same_bits(two(ws, x), first)
    _assert_same_bits(layers([determinism.distinct_causal_window(t, 0)])(ws[:1], x),
                      layers([None])(ws[:1], x))


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
