"""Training recipes: which format quantizes which GEMM operand in fprop, dgrad and wgrad.

For y = x @ w (x[M, K] activations, w[K, N] weights, dy[M, N] the output gradient):
  fprop  y  = x  @ w      operands x (blocks along K) and w (blocks along K)
  dgrad  dx = dy @ w.T    operands dy (blocks along N) and w (blocks along N)
  wgrad  dw = x.T @ dy    operands x (blocks along M) and dy (blocks along M)
A recipe names a format (or None: no quantization, bfloat16) for each of the six operands. Recipes are frozen and
hashable (usable as static arguments of jax.jit).
"""

from __future__ import annotations

import dataclasses

from jax_fp4.formats import MXFP8 as _MXFP8
from jax_fp4.formats import NVFP4 as _NVFP4
from jax_fp4.formats import Format

__all__ = ["Recipe", "BF16", "MXFP8", "NVFP4", "NVFP4Fwd_MXFP8Bwd", "NVFP4_1x64", "RECIPES", "by_name"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Formats of the six GEMM operands (None = not quantized). See the module docstring for the orientations."""

    name: str
    fprop_x: Format | None = None
    fprop_w: Format | None = None
    dgrad_dy: Format | None = None
    dgrad_w: Format | None = None
    wgrad_x: Format | None = None
    wgrad_dy: Format | None = None

    @property
    def quantized(self) -> bool:
        return any(f is not None for f in self.formats())

    def formats(self):
        return (self.fprop_x, self.fprop_w, self.dgrad_dy, self.dgrad_w, self.wgrad_x, self.wgrad_dy)

    @property
    def needs_key(self) -> bool:
        """Whether some operand uses stochastic rounding (then dense/dot_general need a PRNG key)."""
        return any(isinstance(f, _NVFP4) and f.stochastic_rounding for f in self.formats())

    def __post_init__(self):
        for pair, (a, b) in {"fprop": (self.fprop_x, self.fprop_w), "dgrad": (self.dgrad_dy, self.dgrad_w),
                             "wgrad": (self.wgrad_x, self.wgrad_dy)}.items():
            if (a is None) != (b is None):
                raise ValueError(f"Recipe {self.name}: both {pair} operands are quantized or neither ({a!r}, {b!r})")
            rht = [isinstance(f, _NVFP4) and f.rht for f in (a, b)]
            if rht[0] != rht[1]:
                raise ValueError(f"Recipe {self.name}: RHT must be on both {pair} operands or neither")


def BF16() -> Recipe:
    """No quantization: plain bfloat16 (or the input dtype) GEMMs, as `jnp.dot`."""
    return Recipe("bf16")


def MXFP8(gradients: str = "e4m3") -> Recipe:
    """MXFP8 for every operand: E4M3 (default), or "e5m2" for the gradient dy ("hybrid")."""
    if gradients not in ("e4m3", "e5m2"):
        raise ValueError(f"MXFP8 recipe: gradients must be 'e4m3' or 'e5m2', got {gradients!r}")
    f, g = _MXFP8(), _MXFP8(element=gradients)
    return Recipe("mxfp8" if gradients == "e4m3" else "mxfp8-hybrid", f, f, g, f, f, g)


def NVFP4(rht: bool = True, weight_2d: bool = True, stochastic_rounding: bool = True) -> Recipe:
    """NVFP4 everywhere with the usual defaults (each switchable): 16x16 2D scaling of the weight, stochastic
    rounding of the gradient dy, and the RHT on the wgrad operands (x and dy blocked along M)."""
    w = _NVFP4(scaling_2d=weight_2d)
    x = _NVFP4()
    dy = _NVFP4(stochastic_rounding=stochastic_rounding)
    wgrad_x = _NVFP4(rht=rht)
    wgrad_dy = _NVFP4(rht=rht, stochastic_rounding=stochastic_rounding)
    return Recipe("nvfp4", x, w, dy, w, wgrad_x, wgrad_dy)


def NVFP4Fwd_MXFP8Bwd(gradients: str = "e4m3") -> Recipe:
    """NVFP4 (rowwise 1D) for x and w in fprop; MXFP8 for every dgrad and wgrad operand."""
    m = MXFP8(gradients)
    return Recipe("nvfp4-fwd-mxfp8-bwd", _NVFP4(), _NVFP4(), m.dgrad_dy, m.dgrad_w, m.wgrad_x, m.wgrad_dy)


def NVFP4_1x64(gradients: str = "e4m3") -> Recipe:
    """NVFP4 1x64 local encode for x and w in fprop (TE PR #2941); MXFP8 backward."""
    m = MXFP8(gradients)
    f = _NVFP4(local_1x64=True)
    return Recipe("nvfp4-1x64", f, f, m.dgrad_dy, m.dgrad_w, m.wgrad_x, m.wgrad_dy)


RECIPES = {"bf16": BF16, "mxfp8": MXFP8, "nvfp4": NVFP4, "nvfp4-fwd-mxfp8-bwd": NVFP4Fwd_MXFP8Bwd,
           "nvfp4-1x64": NVFP4_1x64}


def by_name(name: str) -> Recipe:
    """The default recipe of a name in RECIPES (the CLI names of examples/train_lm.py)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]()
