"""Which GEMM shapes a recipe can block, and the error that says where and how to fix it when it cannot.

For y = x @ w with x [M, K], w [K, N] and dy [M, N] (`jax_fp4.recipes`), each quantized operand is blocked along one
axis and may constrain the other:

  role      tensor  block axis  other axis
  fprop x   x       K           M
  fprop w   w       K           N
  dgrad dy  dy      N           M
  dgrad w   w       N           K
  wgrad x   x       M           K
  wgrad dy  dy      M           N

A format needs its block axis to be a multiple of its block (NVFP4 16, MXFP8 32, NVFP4 1x64 64) and, for NVFP4 16x16
2D scaling (16) and the 1x64 encode (64), the other axis too (`Format.validate` is the rule; `needs` restates it per
operand and a test checks both agree). A forward-only call (inference) quantizes only the fprop operands, and pads an
NVFP4 1x64 fprop operand's other axis (x's M, w's N) to 64, so it needs less than a differentiated one (training).

A grouped GEMM (`jax_fp4.ragged_dot`, x [T, K] in token groups, w [G, K, N]) has the same roles with M the T rows:
the fprop and dgrad operands constrain K and N as above, and the wgrad operands block along each group's tokens, so
every group size must be a multiple of their block (`check_grouped`).
"""

from __future__ import annotations

import math

from jax_fp4.formats import Format
from jax_fp4.recipes import RECIPES, Recipe, resolve

__all__ = ["BlockingError", "ROLES", "operand_needs", "needs", "check", "unblocked", "recipes_that_block",
           "layer_note", "check_grouped"]

#: role -> (recipe field, tensor, block-axis dimension, other-axis dimension).
ROLES = {
    "fprop x": ("fprop_x", "x", "K", "M"), "fprop w": ("fprop_w", "w", "K", "N"),
    "dgrad dy": ("dgrad_dy", "dy", "N", "M"), "dgrad w": ("dgrad_w", "w", "N", "K"),
    "wgrad x": ("wgrad_x", "x", "M", "K"), "wgrad dy": ("wgrad_dy", "dy", "M", "N"),
}
_FPROP = ("fprop x", "fprop w")


class BlockingError(ValueError):
    """A GEMM's shapes cannot be blocked by its recipe's formats; the message names the GEMM operand roles, the
    dimensions, the layer (where known) and the fixes. `with_layer(path, where=None)` is the same error naming the layer
    (the Flax layers add their module path this way) and, when given, the operation that raised."""

    def __init__(self, msg: str, details: dict | None = None):
        super().__init__(msg)
        self.details = details

    def with_layer(self, layer: str | None, where: str | None = None) -> BlockingError:
        if self.details is None or not layer or self.details.get("layer"):
            return self
        d = dict(self.details, layer=layer, **({} if where is None else {"where": where}))
        return BlockingError((grouped_message if "T" in d else message)(**d), d)


def operand_needs(fmt: Format | None, role: str, *, differentiated: bool = True) -> dict[str, int]:
    """{dimension: multiple} that operand `role` of format `fmt` needs ({} for an unquantized operand)."""
    if fmt is None:
        return {}
    _, _, block_dim, other_dim = ROLES[role]
    block = fmt.block_size
    other = 1
    if getattr(fmt, "local_1x64", False):
        block = other = fmt.window_size
        if role in _FPROP:  # padded to 64 by dense (x's M, w's N): no constraint on the other axis
            other = 1
    elif getattr(fmt, "scaling_2d", False):
        other = fmt.tile_2d
    out = {block_dim: block}
    if other > 1:
        out[other_dim] = math.lcm(out.get(other_dim, 1), other)
    return out


def needs(recipe: Recipe, *, differentiated: bool) -> dict[str, int]:
    """{"M", "K", "N": the multiple each must be} for `recipe`: every operand when differentiated (training), the
    fprop operands only when not (inference). 1 means any size. `recipe`: a Recipe or its name."""
    recipe = resolve(recipe, "blocking.needs")
    out = {"M": 1, "K": 1, "N": 1}
    for role, (field, *_rest) in ROLES.items():
        if not differentiated and role not in _FPROP:
            continue
        for dim, mult in operand_needs(getattr(recipe, field), role, differentiated=differentiated).items():
            out[dim] = math.lcm(out[dim], mult)
    return out


def unblocked(recipe: Recipe, M: int, K: int, N: int, *, differentiated: bool) -> list[str]:
    """One line per operand of `recipe` that cannot be blocked at these sizes (empty when every one can), e.g.
    "dgrad dy [M=64, N=16] (MXFP8() blocks along N): N=16 is not a multiple of 32"."""
    recipe = resolve(recipe, "blocking.unblocked")
    sizes = {"M": M, "K": K, "N": N}
    bad = []
    for role, (field, _tensor, block_dim, other_dim) in ROLES.items():
        if not differentiated and role not in _FPROP:
            continue
        fmt = getattr(recipe, field)
        wrong = [f"{d}={sizes[d]} is not a multiple of {m}" for d, m in
                 operand_needs(fmt, role, differentiated=differentiated).items() if sizes[d] % m]
        if wrong:
            dims = sorted((block_dim, other_dim), key="MKN".index)
            shape = ", ".join(f"{d}={sizes[d]}" for d in dims)
            bad.append(f"{role} [{shape}] ({fmt!r} blocks along {block_dim}): {'; '.join(wrong)}")
    return bad


def recipes_that_block(M: int | None, K: int, N: int, *, differentiated: bool) -> list[str]:
    """The names of the quantized default recipes (`recipes.RECIPES`) that block these sizes (M None: any M that
    the recipe allows)."""
    out = []
    for name, make in RECIPES.items():
        r = make()
        if not r.quantized:
            continue
        need = needs(r, differentiated=differentiated)
        if K % need["K"] == 0 and N % need["N"] == 0 and (M is None or M % need["M"] == 0):
            out.append(name)
    return out


def check(recipe: Recipe, M: int, K: int, N: int, *, differentiated: bool, where: str = "jax_fp4.dense",
          layer: str | None = None) -> None:
    """BlockingError naming every operand of `recipe` that cannot be blocked at x [M, K] . w [K, N] (see the module
    docstring), the layer when given, and the fixes: pad the dimension, another recipe (the default recipes that do
    block these sizes), or a policy rule that keeps the layer unquantized."""
    bad = unblocked(recipe, M, K, N, differentiated=differentiated)
    if bad:
        d = dict(recipe=recipe, M=M, K=K, N=N, bad=bad, differentiated=differentiated, where=where, layer=layer)
        raise BlockingError(message(**d), d)


def message(recipe: Recipe, M: int, K: int, N: int, bad: list[str], *, differentiated: bool, where: str,
            layer: str | None) -> str:
    """The text of `check`'s BlockingError."""
    need = needs(recipe, differentiated=differentiated)
    pads = [f"{d} to a multiple of {need[d]}" for d, v in (("M", M), ("K", K), ("N", N)) if v % need[d]]
    others = [n for n in recipes_that_block(M, K, N, differentiated=differentiated) if n != recipe.name]
    pattern = layer if layer else "<layer path>"
    mode = "differentiated (training: fprop, dgrad and wgrad operands)" if differentiated else \
        "forward only (inference: fprop operands)"
    return (f"{where}: recipe {recipe.name} cannot block the GEMM x [M={M}, K={K}] . w [K={K}, N={N}]"
            + (f" of layer {layer!r}" if layer else "") + f", {mode}: " + "; ".join(bad)
            + ". Fixes: pad " + " and ".join(pads)
            + (f"; or a recipe that blocks these sizes ({', '.join(others)})" if others else "")
            + f"; or keep the layer unquantized with a policy rule, e.g. jax_fp4.policy.exclude({pattern!r}) "
            "(README: \"Shapes each recipe can block\")")


def layer_note(recipe: Recipe | None, K: int, N: int) -> str:
    """A policy-table note for a layer with a [K, N] kernel: "" when `recipe` (None or unquantized: no recipe) blocks
    K and N in training and inference, else why not and what does, e.g. "CANNOT BLOCK: mxfp8 needs N % 32 == 0
    (N=16) in training; nvfp4 blocks it". The token count M is not a layer's property: `needs` gives its multiple."""
    train = recipes_that_block(None, K, N, differentiated=True)
    infer = recipes_that_block(None, K, N, differentiated=False)
    if not infer:
        return (f"NO RECIPE CAN BLOCK K={K}, N={N}: keep it unquantized (a policy rule, "
                f"jax_fp4.policy.exclude(path))")
    if recipe is None or not recipe.quantized:
        return "" if train else f"no recipe blocks K={K}, N={N} in training (inference: {', '.join(infer)})"
    out = []
    for mode, diff in (("training", True), ("inference", False)):
        need = needs(recipe, differentiated=diff)
        wrong = [f"{d} % {need[d]} == 0 ({d}={v})" for d, v in (("K", K), ("N", N)) if v % need[d]]
        if wrong:
            out.append(f"{' and '.join(wrong)} in {mode}")
    if not out:
        return ""
    alt = ", ".join(train) if train else f"no recipe in training; in inference {', '.join(infer)}"
    return f"CANNOT BLOCK: {recipe.name} needs {'; '.join(out)}; blocks it: {alt}"


def check_grouped(recipe: Recipe, T: int, K: int, N: int, group_sizes=None, *, differentiated: bool,
                  where: str = "jax_fp4.ragged_dot", layer: str | None = None) -> None:
    """BlockingError for a grouped GEMM x [T, K] . w [G, K, N] (`jax_fp4.ragged_dot`): the K / N constraints of the
    fprop (and, differentiated, dgrad) operands as `check`, and, differentiated, the wgrad operands' block along each
    group's tokens: every size in `group_sizes` (numpy, when known at trace time; None: not checked here) a multiple
    of their block. The message names each operand role, the dimension or group, the layer when given and the
    fixes (pad K / N, pad the groups, another recipe, a policy rule)."""
    sizes = {"K": K, "N": N}
    bad = []
    for role, (field, _tensor, block_dim, other_dim) in ROLES.items():
        if not differentiated and role not in _FPROP:
            continue
        fmt = getattr(recipe, field)
        if fmt is None:
            continue
        if block_dim == "M":  # wgrad: blocks along each group's tokens
            if group_sizes is not None:
                wrong = [f"group {g} has {int(n)} rows" for g, n in enumerate(group_sizes) if int(n) % fmt.block_size]
                if wrong:
                    bad.append(f"{role} ({fmt!r} blocks along each group's T rows): {', '.join(wrong[:4])}"
                               f"{' ...' if len(wrong) > 4 else ''}, not a multiple of {fmt.block_size}")
            continue
        wrong = [f"{d}={sizes[d]} is not a multiple of {m}" for d, m in
                 operand_needs(fmt, role, differentiated=differentiated).items() if d in sizes and sizes[d] % m]
        if wrong:
            dims = ", ".join(f"{d}={sizes[d]}" if d in sizes else "T" for d in sorted((block_dim, other_dim),
                                                                                     key="MKN".index))
            bad.append(f"{role} [{dims.replace('M', 'T')}] ({fmt!r} blocks along {block_dim}): {'; '.join(wrong)}")
    if bad:
        d = dict(recipe=recipe, T=T, K=K, N=N, bad=bad, differentiated=differentiated, where=where, layer=layer)
        raise BlockingError(grouped_message(**d), d)


def grouped_message(recipe: Recipe, T: int, K: int, N: int, bad: list[str], *, differentiated: bool, where: str,
                    layer: str | None) -> str:
    """The text of `check_grouped`'s BlockingError."""
    need = needs(recipe, differentiated=differentiated)
    pads = [f"{d} to a multiple of {need[d]}" for d, v in (("K", K), ("N", N)) if v % need[d]]
    if need["M"] > 1 and any(line.startswith("wgrad") for line in bad):
        pads.append(f"every group to a multiple of {need['M']} rows with zero rows (jax_fp4.flax.moe.group_alignment; "
                    "MoEMLP pads its groups so)")
    others = [n for n in recipes_that_block(None, K, N, differentiated=differentiated)
              if n != recipe.name and _grouped_recipe(RECIPES[n]())]
    pattern = layer if layer else "<layer path>"
    mode = "differentiated (training: fprop, dgrad and wgrad operands)" if differentiated else \
        "forward only (inference: fprop operands)"
    return (f"{where}: recipe {recipe.name} cannot block the grouped GEMM x [T={T}, K={K}] . w [G, K={K}, N={N}]"
            + (f" of layer {layer!r}" if layer else "") + f", {mode}: " + "; ".join(bad)
            + ". Fixes: pad " + " and ".join(pads)
            + (f"; or a recipe that blocks K and N ({', '.join(others)})" if others else "")
            + f"; or keep the layer unquantized with a policy rule, e.g. jax_fp4.policy.exclude({pattern!r}) "
            "(README: \"Shapes each recipe can block\")")


def _grouped_recipe(recipe: Recipe) -> bool:
    """Whether a recipe's token operands (x, dy) are grouped formats (no NVFP4 1x64 or 16x16 2D x / dy)."""
    return not any(f is not None and (f.local_1x64 or f.scaling_2d)
                   for f in (recipe.fprop_x, recipe.wgrad_x, recipe.dgrad_dy, recipe.wgrad_dy))
