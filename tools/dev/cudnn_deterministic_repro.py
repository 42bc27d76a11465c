"""Pure-JAX reproducer: under XLA's deterministic ops, a step with two identical differentiated cuDNN attention calls
does not compile (jaxlib 0.11.2, CUDA 13 plugin, H200).

XLA aborts with `IndexError: absl::container_internal::raw_hash_map<>::at` (its cuDNN compiled-graph cache; see
openxla/xla PR #46500), with `xla_gpu_deterministic_ops` and with `xla_gpu_exclude_nondeterministic_ops` alike.
Forward-only calls compile; so do backward calls whose cuDNN graphs differ. A causal window of at least seq - 1
positions masks nothing more than causality, so `jax_fp4.determinism.distinct_causal_window(seq, site)` gives each
call its own graph and the same values; the LM harness uses it for `--deterministic --attention cudnn`.

    python3 tools/dev/cudnn_deterministic_repro.py

prints one line per case. Measured with the same calls (H200, jaxlib 0.11.2): "identical" fails, "forward only" and
"distinct windows" compile, and "window equals plain" (one layer: window (seq - 1, 0) against plain causal, values
and gradients) is True.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4 import determinism

B, T, H, D = 4, 512, 8, 64


def loss(params, x, windows):
    h = x
    for w, win in zip(params, windows, strict=True):
        qkv = (h @ w).reshape(B, T, H, D)
        h = h + jax.nn.dot_product_attention(qkv, qkv, qkv, is_causal=True, local_window_size=win,
                                             implementation="cudnn").reshape(h.shape)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def compiled(fun, windows, params, x):
    return jax.jit(fun, static_argnums=2).lower(params, x, windows).compile(
        compiler_options=determinism.compiler_options())


def main():
    key = jax.random.key(0)
    params = [jax.random.normal(jax.random.fold_in(key, i), (H * D, H * D), jnp.bfloat16) * 0.05 for i in range(2)]
    x = jax.random.normal(jax.random.fold_in(key, 9), (B, T, H * D), jnp.bfloat16)
    grad = jax.value_and_grad(loss)
    cases = {"identical": (grad, (None, None)), "forward only": (loss, (None, None)),
             "distinct windows": (grad, tuple(determinism.distinct_causal_window(T, i) for i in range(2)))}
    for name, (fun, windows) in cases.items():
        try:
            jax.block_until_ready(compiled(fun, windows, params, x)(params, x))
            print(f"{name}: compiled", flush=True)
        except Exception as e:  # the abort surfaces as a Python exception
            print(f"{name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    one = params[:1]
    a = compiled(grad, (determinism.distinct_causal_window(T, 0),), one, x)(one, x)
    b = compiled(grad, (None,), one, x)(one, x)
    same = all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                            strict=True))
    print(f"window equals plain: {same}", flush=True)


if __name__ == "__main__":
    main()
