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

import jax
import jax.numpy as jnp

from jax_fp4.formats import MXFP8 as _MXFP8
from jax_fp4.formats import NVFP4 as _NVFP4
from jax_fp4.formats import Format

__all__ = ["Recipe", "BF16", "MXFP8", "NVFP4", "NVFP4Fwd_MXFP8Bwd", "NVFP4_1x64", "RECIPES", "by_name", "resolve"]

_OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")


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
        """Whether some operand uses stochastic rounding (then a differentiated dense/dot_general needs a key)."""
        return any(f is not None and f.needs_key for f in self.formats())

    @property
    def fprop_needs_key(self) -> bool:
        """Whether an fprop operand uses stochastic rounding (then even a forward-only call needs a PRNG key)."""
        return any(f is not None and f.needs_key for f in (self.fprop_x, self.fprop_w))

    def check_key(self, key, where: str, *, backward: bool) -> None:
        """ValueError naming `where` when `key` is None but the forward (backward=False) or the forward and backward
        (backward=True, a differentiated call) round stochastically; TypeError when `key` is neither None nor a
        JAX PRNG key (a typed key `jax.random.key(...)` or a raw uint32[2] `jax.random.PRNGKey(...)`)."""
        if key is not None:
            typed = hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            raw = hasattr(key, "dtype") and not typed and key.dtype == jnp.uint32 and tuple(jnp.shape(key))[-1:] == (2,)
            if not (typed or raw):
                got = f"{key.dtype}{list(jnp.shape(key))}" if hasattr(key, "dtype") else repr(key)
                raise TypeError(f"{where}: key must be a JAX PRNG key (jax.random.key(seed)), got "
                                f"{type(key).__name__} {got}")
            return
        if self.fprop_needs_key:
            raise ValueError(f"{where}: recipe {self.name} rounds an fprop operand stochastically and needs key=...")
        if backward and self.needs_key:
            raise ValueError(f"{where}: recipe {self.name} rounds a gradient operand stochastically: differentiating "
                             "it needs key=... (forward-only calls need none); a Flax Linen model takes it as "
                             "module.apply(variables, x, rngs={'quantize': key}), NNX layers from their rng stream")

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"Recipe: name must be a str, got {type(self.name).__name__} {self.name!r}")
        for field in _OPERANDS:
            f = getattr(self, field)
            if f is not None and not isinstance(f, Format):
                raise TypeError(f"Recipe {self.name}: {field} must be a jax_fp4 Format (e.g. jax_fp4.NVFP4()) or None, "
                                f"got {type(f).__name__} {f!r}")
        for pair, (a, b) in {"fprop": (self.fprop_x, self.fprop_w), "dgrad": (self.dgrad_dy, self.dgrad_w),
                             "wgrad": (self.wgrad_x, self.wgrad_dy)}.items():
            if (a is None) != (b is None):
                raise ValueError(f"Recipe {self.name}: both {pair} operands are quantized or neither ({a!r}, {b!r})")
            rht = [f is not None and f.rht for f in (a, b)]
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
    return Recipe("mxfp8" + _hybrid(gradients), f, f, g, f, f, g)


def _hybrid(gradients: str) -> str:
    """The name suffix of E5M2 gradients ("hybrid", TE's term for E4M3 forward / E5M2 backward)."""
    return "-hybrid" if gradients == "e5m2" else ""


def _four_over_six(on: bool) -> str:
    """The name suffix of 4over6 forward operands (`NVFP4(use_4over6=True)`)."""
    return "-4over6" if on else ""


def NVFP4(rht: bool = True, weight_2d: bool = True, stochastic_rounding: bool = True,
          four_over_six: bool = False) -> Recipe:
    """NVFP4 everywhere with the usual defaults (each switchable): 16x16 2D scaling of the weight, stochastic
    rounding of the gradient dy, and the RHT on the wgrad operands (x and dy blocked along M). four_over_six: the
    fprop operands x and w use 4over6 block selection (`NVFP4(use_4over6=True)`, on the E4M3 bound 256; TE applies
    it to forward operands, never with RHT or stochastic rounding); name suffix "-4over6"."""
    w = _NVFP4(scaling_2d=weight_2d)
    fwd_w = _NVFP4(scaling_2d=weight_2d, use_4over6=four_over_six)
    x = _NVFP4(use_4over6=four_over_six)
    dy = _NVFP4(stochastic_rounding=stochastic_rounding)
    wgrad_x = _NVFP4(rht=rht)
    wgrad_dy = _NVFP4(rht=rht, stochastic_rounding=stochastic_rounding)
    name = "nvfp4" + "".join(s for s, on in (("-no-rht", rht), ("-no-2d", weight_2d), ("-no-sr", stochastic_rounding))
                             if not on) + _four_over_six(four_over_six)
    return Recipe(name, x, fwd_w, dy, w, wgrad_x, wgrad_dy)


def NVFP4Fwd_MXFP8Bwd(gradients: str = "e4m3", four_over_six: bool = False) -> Recipe:
    """NVFP4 (rowwise 1D) for x and w in fprop; MXFP8 for every dgrad and wgrad operand. four_over_six: the fprop
    operands use 4over6 block selection (`NVFP4(use_4over6=True)`); name suffix "-4over6"."""
    m = MXFP8(gradients)
    name = "nvfp4-fwd-mxfp8-bwd" + _hybrid(gradients) + _four_over_six(four_over_six)
    f = _NVFP4(use_4over6=four_over_six)
    return Recipe(name, f, f, m.dgrad_dy, m.dgrad_w, m.wgrad_x, m.wgrad_dy)


def NVFP4_1x64(gradients: str = "e4m3") -> Recipe:
    """NVFP4 1x64 local encode for x and w in fprop (TE PR #2941); MXFP8 backward."""
    m = MXFP8(gradients)
    f = _NVFP4(local_1x64=True)
    return Recipe("nvfp4-1x64" + _hybrid(gradients), f, f, m.dgrad_dy, m.dgrad_w, m.wgrad_x, m.wgrad_dy)


RECIPES = {"bf16": BF16, "mxfp8": MXFP8, "nvfp4": NVFP4, "nvfp4-fwd-mxfp8-bwd": NVFP4Fwd_MXFP8Bwd,
           "nvfp4-1x64": NVFP4_1x64}


def _all_variants() -> dict[str, Recipe]:
    """Every recipe the factories above make, by name (names encode the options: "-hybrid" for E5M2 gradients;
    "-no-rht", "-no-2d", "-no-sr" for NVFP4's switches turned off; "-4over6" for 4over6 forward operands)."""
    out = [BF16()]
    for g in ("e4m3", "e5m2"):
        out += [MXFP8(g), NVFP4Fwd_MXFP8Bwd(g), NVFP4Fwd_MXFP8Bwd(g, True), NVFP4_1x64(g)]
    out += [NVFP4(a, b, c, d) for a in (True, False) for b in (True, False) for c in (True, False)
            for d in (False, True)]
    return {r.name: r for r in out}


def by_name(name: str) -> Recipe:
    """The recipe of a name: the defaults of RECIPES (the CLI names of examples/lm/train_lm.py) or any option variant
    the factories make, so ``by_name(r.name) == r`` for every recipe of this module (e.g. "mxfp8-hybrid",
    "nvfp4-no-rht-no-sr"; the suffixes "-no-rht", "-no-2d", "-no-sr" come in that order). Case and surrounding
    white space are ignored ("MXFP8" names mxfp8); "_" may stand for "-".

    Raises:
      TypeError: `name` is not a str. ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        raise TypeError(f"recipes.by_name: name must be a str, got {type(name).__name__} {name!r}")
    variants = _all_variants()
    key = name.strip().lower().replace("_", "-")
    if key not in variants:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(variants)}")
    return variants[key]


def resolve(recipe, where: str = "jax_fp4") -> Recipe:
    """`recipe` itself when it is a Recipe, `by_name(recipe)` when it is a str; else TypeError naming `where`."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return by_name(recipe)
    raise TypeError(f"{where}: recipe must be a jax_fp4.recipes.Recipe or a recipe name (recipes.by_name), got "
                    f"{type(recipe).__name__} {recipe!r}")
