"""The ragged (grouped) product of the expert GEMMs, and which library computes it.

`jax_fp4.ragged_dot`, `jax_fp4.flax.moe.MoEMLP` and the expert-parallel layers take ``implementation``:
  "xla"      `jax.lax.ragged_dot_general`. XLA:CPU and TPUs run it as a grouped GEMM. XLA:GPU (jaxlib 0.11.2)
             rewrites it into a dense dot over every group ([rows, K] x [K, G x N], masked), so its cost grows with
             the number of groups G (docs/performance.md, "MoE expert parallelism").
  "tokamax"  `tokamax.ragged_dot_general` (PyPI `tokamax`, extra ``jax_fp4[tokamax]``), whose Pallas kernels
             (Mosaic GPU, Triton) run the grouped GEMM on NVIDIA GPUs; tokamax falls back to its XLA
             implementation where no kernel takes the shapes (and on the CPU, where the bits are "xla"'s).
Both take the same operands (the exact operands of the emulated GEMM, or a BF16 recipe's inputs) with float32
accumulation; on GPUs their summation orders differ, as two GEMM libraries' do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_fp4._src.emulation.product import cpu_float32_operands

__all__ = ["IMPLEMENTATIONS", "check_implementation", "ragged_product", "ragged_dot_plain"]

IMPLEMENTATIONS = ("xla", "tokamax")  # tokamax picks among its kernels that imported, then its XLA implementation


def check_implementation(implementation, where: str) -> str:
    """`implementation` if it names one of IMPLEMENTATIONS; "tokamax" also needs the tokamax package.

    Raises:
      ValueError: another value (naming `where` and the choices).
      ImportError: "tokamax" without tokamax installed (with the pip command).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{where}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "tokamax":
        _tokamax()
    return implementation


def _tokamax():
    try:
        import tokamax
        from absl import flags
    except ImportError as e:
        raise ImportError("implementation='tokamax' needs the tokamax package: pip install 'jax_fp4[tokamax]' "
                          f"(or pip install tokamax) ({e})") from None
    pair = _version_pair(jax.__version__, getattr(tokamax, "__version__", "0"))
    if pair is not None:
        raise ImportError(pair)
    # tokamax reads its options as absl flags and, when nothing parsed them, parses sys.argv: a program with its own
    # command line (pytest, train_lm.py) then fails on its first flag. Unparsed, the flags take their defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def _release(version: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:3])


# jax 0.11 renamed the Pallas Mosaic GPU kernel's `out_shape=` to `out_type=`; tokamax <= 0.0.12 passes out_shape=
# (its kernels fail at trace time with "Mesh.__init__() got an unexpected keyword argument 'out_shape'") and
# tokamax >= 0.0.13 requires jax >= 0.11.
TOKAMAX_FOR_JAX_0_11 = (0, 0, 13)


def _version_pair(jax_version: str, tokamax_version: str) -> str | None:
    """None when this tokamax release runs under this jax release, else the error message naming both."""
    old_jax, old_tokamax = _release(jax_version) < (0, 11), _release(tokamax_version) < TOKAMAX_FOR_JAX_0_11
    if old_jax == old_tokamax:
        return None
    want = "<= 0.0.12" if old_jax else ">= 0.0.13"
    return (f"implementation='tokamax': tokamax {tokamax_version} does not run under jax {jax_version} (the Pallas "
            f"Mosaic GPU kernel API changed in jax 0.11); install tokamax {want}: pip install 'jax_fp4[tokamax]' "
            "resolves it")


def _general(implementation):
    if implementation == "tokamax":
        return _tokamax().ragged_dot_general
    return lax.ragged_dot_general


def ragged_product(va, vb, group_sizes, dimension_numbers, *, precision, implementation: str = "xla"):
    """float32 `ragged_dot_general(va, vb, group_sizes, dimension_numbers)` of two operands of one dtype (bfloat16
    or float32), accumulated in float32, by `implementation`. A bfloat16 product takes float32 operands on the CPU
    (`cpu_float32_operands`: XLA:CPU runs no bfloat16 x bfloat16 -> float32 dot outside its XNNPACK fusion)."""
    general = _general(implementation)
    if implementation == "tokamax" and va.dtype == vb.dtype == jnp.bfloat16:
        # bfloat16 x bfloat16 products are exact in float32, so DEFAULT is HIGHEST's arithmetic here; tokamax's
        # kernels take only the default precision (another one falls through to its XLA implementation)
        precision = None

    def dot(a, b):
        return general(a, b, group_sizes, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)

    return dot(va, vb) if va.dtype == jnp.float32 else cpu_float32_operands(dot, va, vb)


def ragged_dot_plain(lhs, rhs, group_sizes, implementation: str = "xla"):
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` (a BF16 recipe's expert GEMM, differentiated by the library's own
    rule), or tokamax's; the result in the promoted input dtype."""
    if implementation == "tokamax":
        return _tokamax().ragged_dot(lhs, rhs, group_sizes)
    return lax.ragged_dot(lhs, rhs, group_sizes)
