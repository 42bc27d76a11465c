"""Run-to-run determinism for training steps that use jax_fp4: same inputs, same bits, on every run.

jax_fp4's own kernels are deterministic: quantize, dequantize and the GEMM emulation fix their reduction order, the
tensor amax is an order-free maximum (an atomic max on the CUDA side), and stochastic rounding and the RHT sign
vector draw from the JAX keys they are given. What varies between two runs of one program on a GPU is XLA's part:
scatter-adds (an embedding's gradient) and some reductions run with atomics, and autotuning may pick another GEMM
algorithm per process. Three things make a step reproducible:

1. Compile the step with XLA's deterministic ops (`compiler_options()`, passed to `jax.jit(...,
   compiler_options=...)`, or `jit` here). This is XLA's `--xla_gpu_deterministic_ops` set for this program only:
   deterministic scatter and reduction emitters, autotuning off. It has no effect on the CPU, whose programs are
   deterministic already.
2. Run attention through XLA (`attention_implementation(True)` gives "xla" for `jax.nn.dot_product_attention`):
   under deterministic ops XLA aborts while compiling a quantized step on a mesh with cuDNN's fused attention
   (`std::out_of_range` from its fused-attention graph cache; jaxlib 0.11.2), while XLA's attention compiles and is
   reproducible. On one device XLA compiles cuDNN's fused attention under deterministic ops (the LM harness's
   `--deterministic --attention cudnn`); whether two runs then give equal bits is what its one-GPU test checks.
   One condition: no two cuDNN attention call sites of the step may be identical. With two identical backward
   attention graphs (two unrolled blocks, or two scanned segments) XLA aborts while compiling (`IndexError:
   raw_hash_map::at` from its compiled-graph cache; openxla/xla PR #46500; jaxlib 0.11.2, also with
   `xla_gpu_exclude_nondeterministic_ops`; docs/performance.md, "Measuring gaps"). `distinct_causal_window(seq_len,
   site)` gives each call site its own `local_window_size` that masks nothing beyond causality: the graphs differ,
   the values do not.
3. Give every stochastic-rounding and RHT key from a fixed seed (the Flax layers' rng streams live in the model
   state, so a restored checkpoint continues the same draws).

Collectives over a fixed mesh reduce in a fixed order (NCCL's ring and tree schedules depend on the topology, not on
timing), so data-, fsdp- and tensor-parallel steps are reproducible on the same devices; a different device count
or mesh sums in another order and gives other bits. `checksum` compares two states bit for bit. The cost in speed
is measured in docs/performance.md ("Measuring gaps").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import jax
import numpy as np

__all__ = ["COMPILER_OPTIONS", "compiler_options", "jit", "attention_implementation", "distinct_causal_window",
           "checksum"]

# XLA's debug option behind --xla_gpu_deterministic_ops (xla/xla.proto, DebugOptions.xla_gpu_deterministic_ops):
# deterministic scatter / reduction emitters and no autotuning, for the program compiled with it.
COMPILER_OPTIONS = {"xla_gpu_deterministic_ops": True}


def compiler_options(deterministic: bool = True) -> dict:
    """The `compiler_options` of `jax.jit` for a deterministic program ({} when `deterministic` is False).

    Example: ``step = jax.jit(train_step, donate_argnums=0, compiler_options=compiler_options())``.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    return dict(COMPILER_OPTIONS) if deterministic else {}


def jit(fun: Callable, *, deterministic: bool = True, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` compiled with `compiler_options(deterministic)` merged into any
    `compiler_options` given (the given ones win where both name an option)."""
    opts = {**compiler_options(deterministic), **(jit_kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fun, compiler_options=opts or None, **jit_kwargs)


def attention_implementation(deterministic: bool, backend: str | None = None) -> str | None:
    """The `implementation` argument of `jax.nn.dot_product_attention` for a step compiled with
    `compiler_options(deterministic)`: "xla" when deterministic (see the module docstring, point 2), else "cudnn"
    (the fused flash-attention kernel) on a GPU backend and None (XLA's) elsewhere. backend: the platform the step
    runs on (default `jax.default_backend()`)."""
    if deterministic:
        return "xla"
    return "cudnn" if (backend or jax.default_backend()) == "gpu" else None


def distinct_causal_window(seq_len: int, site: int) -> tuple[int, int]:
    """The `local_window_size` (left, right) of `jax.nn.dot_product_attention(..., is_causal=True)` for attention
    call site `site` of a step with sequences of `seq_len` positions: (seq_len - 1 + site, 0). A left window of at
    least seq_len - 1 positions masks nothing that causality does not, so the attention is the same; the window
    differs per site, so cuDNN builds a distinct graph for each call (module docstring, point 2). Equal bit for bit
    to plain causal attention, values and gradients: measured for cuDNN's fused kernel under deterministic ops
    (docs/performance.md, "Measuring gaps") and checked for XLA's implementation by the tests.

    Example (unrolled blocks ``i = 0..n-1``): ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
    local_window_size=distinct_causal_window(q.shape[1], i), implementation="cudnn")``.

    Raises:
      ValueError: seq_len < 1 or site < 0 (not ints, or out of range).
    """
    if not (isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1):
        raise ValueError(f"distinct_causal_window: seq_len must be an int >= 1, got {seq_len!r}")
    if not (isinstance(site, int) and not isinstance(site, bool) and site >= 0):
        raise ValueError(f"distinct_causal_window: site must be an int >= 0, got {site!r}")
    return (seq_len - 1 + site, 0)


def checksum(tree) -> str:
    """The SHA-256 (hex) of every leaf's dtype, shape and bytes, in the tree's flattening order: equal for two trees
    exactly when they are equal bit for bit (NaN payloads and signed zeros included). Typed PRNG keys hash their key
    data. Sharded arrays are gathered to the host (`jax.device_get`), so a state hashes the same on any mesh; an array
    spread over several processes must be gathered first (e.g. `jax.experimental.multihost_utils.process_allgather`,
    as train_lm's `lm_distributed.host_tree` does), since `jax.device_get` reads only addressable shards."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(jax.device_get(leaf))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
