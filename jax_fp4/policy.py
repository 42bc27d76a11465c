"""Precision policy: which training `Recipe` each layer of a model uses, chosen by the layer's module path.

A `Policy` is an ordered tuple of `Rule`s (pattern -> recipe) and a default recipe. A layer's path is its Flax module
path joined by "/" ("blocks/3/mlp/up"; NNX list indices are numbers, Linen submodules their names, e.g.
"blocks_3/mlp/up"). The first rule whose pattern matches the path *or one of its ancestors* ("blocks/3" covers
"blocks/3/mlp/up") gives the layer's recipe; a layer no rule matches gets the default (None: it keeps the recipe it
was built with). Patterns are globs (`fnmatch`; "*" also crosses "/", so "*/mlp" is every MLP) or, prefixed with
"re:", regular expressions matched against the whole path or ancestor ("re:blocks/(0|11)/.*").

Policies are frozen and hashable (tuples of strings and recipes, no arrays): a policy may be a static argument of
`jax.jit`, and the layers it sets keep their recipe in the (static) module definition. Policies compose with `+`
(the left operand's rules first; its default unless None).

The usual forms (the NVFP4 paper keeps ~15 % of the linear layers, mostly the last blocks, in BF16; NVIDIA's
Llama-3-8B NVFP4 run kept the last 4 blocks in BF16; MaxText quantizes the decoder blocks only):

  uniform(recipe)                             every layer `recipe`
  first_blocks(n, recipe) / last_blocks(n, recipe, num_blocks)
  last_fraction(f, recipe, num_blocks)        the last ceil(f * num_blocks) blocks
  mlp_only(recipe=BF16())                     every layer outside the MLPs in `recipe` (the MLPs keep the default)
  exclude(names, recipe=BF16())               the named layers (patterns) in `recipe`

Scanned stacks: `block_segments` splits blocks 0..n-1 into the contiguous runs in which every layer gets the same
recipe, so a scanned model keeps one stack (one `nnx.scan`, one recipe per layer) per run instead of giving up
scanning for per-block rules; `jax_fp4.flax.policy.apply(..., stacks=...)` resolves a stack's layers as its blocks'.

Applying a policy to Flax models: `jax_fp4.flax.policy` (NNX: `apply(policy, model)` sets each jax_fp4 layer's recipe
and, with ``drop_in=True``, the ``dot_general`` of existing layers such as `nnx.Linear`; Linen: a Policy passed as the
``recipe`` of `jax_fp4.flax.linen` layers resolves per layer at trace time). `describe` prints the layer -> recipe
table; a rule that matches no layer raises `UnmatchedRuleError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import math
import re
from collections.abc import Callable, Iterable

from jax_fp4.recipes import BF16, Recipe, by_name

__all__ = ["Rule", "Policy", "UnmatchedRuleError", "uniform", "first_blocks", "last_blocks", "last_fraction",
           "mlp_only", "exclude", "block_segments", "path_str", "format_table", "recording"]


class UnmatchedRuleError(ValueError):
    """A policy rule matched none of a model's layers (a typo in a pattern, or a model without those layers)."""


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> re.Pattern:
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile(fnmatch.translate(pattern))


def _ancestors(path: str) -> list[str]:
    """path and every ancestor: "a/b/c" -> ["a/b/c", "a/b", "a"]."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def path_str(path) -> str:
    """A module path ("blocks/3/mlp", or a tuple of keys / Flax path entries) as the "/"-joined string rules match."""
    if isinstance(path, str):
        return path
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@dataclasses.dataclass(frozen=True)
class Rule:
    """pattern -> recipe. pattern: a glob, or "re:<regex>" (see the module docstring); recipe: a `Recipe` or its
    name (`recipes.by_name`, stored as the Recipe), or None for the policy's default (a rule that shields layers
    from later rules, as `mlp_only` does)."""

    pattern: str
    recipe: Recipe | None

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Rule: pattern must be a non-empty string, got {self.pattern!r}")
        if isinstance(self.recipe, str):  # a recipe name, as everywhere (recipes.by_name; ValueError if unknown)
            object.__setattr__(self, "recipe", by_name(self.recipe))
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise TypeError(f"Rule {self.pattern!r}: recipe must be a jax_fp4.recipes.Recipe, a recipe name or None, "
                            f"got {type(self.recipe).__name__}")
        try:
            _compiled(self.pattern)
        except re.error as e:
            raise ValueError(f"Rule: bad regular expression {self.pattern!r}: {e}") from None

    def matches(self, path: str) -> bool:
        """Whether the pattern matches `path` or one of its ancestors (whole-string match)."""
        rx = _compiled(self.pattern)
        return any(rx.fullmatch(p) for p in _ancestors(path_str(path)))


def _rule(r) -> Rule:
    if isinstance(r, Rule):
        return r
    if isinstance(r, tuple) and len(r) == 2:
        return Rule(*r)
    raise TypeError(f"Policy: a rule must be a Rule or a (pattern, recipe) pair, got {r!r}")


# The active recorder of resolved (path, recipe) pairs (see `recording`); None: not recording.
_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("jax_fp4_policy_recorder", default=None)


@contextlib.contextmanager
def recording():
    """Collect every (policy, path, recipe) that `Policy.resolve` returns inside the block (trace-time bookkeeping of
    the Linen layers, which resolve their policy when traced); yields the list."""
    found: list = []
    token = _RECORDER.set(found)
    try:
        yield found
    finally:
        _RECORDER.reset(token)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Ordered rules over module paths and a default recipe (see the module docstring).

    Args:
      rules: `Rule`s or (pattern, recipe) pairs, tried in order; the first match wins.
      default: the recipe (a `Recipe` or its name) of a layer no rule matches; None: such a layer keeps the recipe
        it was built with.

    Hashable and comparable by value (a valid `jax.jit` static argument).
    """

    rules: tuple[Rule, ...] = ()
    default: Recipe | None = None

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(_rule(r) for r in self.rules))
        if isinstance(self.default, str):  # a recipe name (recipes.by_name)
            object.__setattr__(self, "default", by_name(self.default))
        if self.default is not None and not isinstance(self.default, Recipe):
            raise TypeError(f"Policy: default must be a jax_fp4.recipes.Recipe, a recipe name or None, got "
                            f"{type(self.default).__name__}")

    def __add__(self, other: Policy) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        return Policy(self.rules + other.rules, self.default if self.default is not None else other.default)

    def with_default(self, default: Recipe | None) -> Policy:
        return dataclasses.replace(self, default=default)

    def match(self, path) -> Rule | None:
        """The first rule matching `path` (a "/"-joined string or a tuple of keys), or None."""
        p = path_str(path)
        return next((r for r in self.rules if r.matches(p)), None)

    def resolve(self, path, current: Recipe | None = None) -> Recipe:
        """The recipe of the layer at `path`: the first matching rule's (None: the default), else the default, else
        `current` (the layer's own recipe).

        Raises:
          ValueError: nothing gives a recipe (no match, no default and no `current`).
        """
        p = path_str(path)
        rule = self.match(p)
        recipe = rule.recipe if rule is not None and rule.recipe is not None else self.default
        if recipe is None:
            recipe = current
        if recipe is None:
            raise ValueError(f"Policy: no recipe for layer {p!r}: no rule gives one and the policy has no default")
        rec = _RECORDER.get()
        if rec is not None:
            rec.append((self, p, recipe))
        return recipe

    def unmatched(self, paths: Iterable) -> list[Rule]:
        """The rules that match none of `paths`."""
        ps = [path_str(p) for p in paths]
        return [r for r in self.rules if not any(r.matches(p) for p in ps)]

    def check(self, paths: Iterable, where: str = "the model") -> None:
        """Raises UnmatchedRuleError naming every rule that matches none of `paths` (and the paths there are)."""
        ps = [path_str(p) for p in paths]
        bad = self.unmatched(ps)
        if bad:
            shown = ", ".join(ps[:12]) + (f", ... ({len(ps)} layers)" if len(ps) > 12 else "")
            names = ", ".join(repr(r.pattern) for r in bad)
            raise UnmatchedRuleError(
                f"Policy: rule{'s' * (len(bad) > 1)} {names} match{'es' * (len(bad) == 1)} no layer of {where}; its "
                f"quantizable layers are: {shown or '(none)'}")

    def map(self, fn: Callable[[Recipe], Recipe]) -> Policy:
        """The policy with `fn` applied to every recipe it names (rules and default), e.g. a precision switch."""
        rules = tuple(Rule(r.pattern, None if r.recipe is None else fn(r.recipe)) for r in self.rules)
        return Policy(rules, None if self.default is None else fn(self.default))

    def __str__(self) -> str:
        lines = [f"  {r.pattern!r} -> {r.recipe.name if r.recipe is not None else '(default)'}" for r in self.rules]
        lines.append(f"  default -> {self.default.name if self.default is not None else '(the layer own recipe)'}")
        return "Policy(\n" + "\n".join(lines) + "\n)"


def format_table(rows: Iterable[tuple[str, str, str]]) -> str:
    """A text table of (layer path, recipe name, rule) rows."""
    rows = list(rows)
    w = max([len("layer")] + [len(r[0]) for r in rows])
    v = max([len("recipe")] + [len(r[1]) for r in rows])
    lines = [f"{'layer':<{w}}  {'recipe':<{v}}  rule", f"{'-' * w}  {'-' * v}  ----"]
    lines += [f"{p:<{w}}  {n:<{v}}  {rule}" for p, n, rule in rows]
    return "\n".join(lines)


# ---- the usual forms -------------------------------------------------------------------------------------------------
BLOCK = "blocks/{i}"  # the path of transformer block i (NNX: an nnx.List named blocks; Linen: e.g. "blocks_{i}")


def uniform(recipe: Recipe) -> Policy:
    """Every layer `recipe`."""
    return Policy((), recipe)


def _blocks(indices: Iterable[int], recipe: Recipe | None, block: str) -> Policy:
    return Policy(tuple(Rule(block.format(i=i), recipe) for i in indices))


def _count(n: int, what: str) -> int:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{what}: the number of blocks must be an integer >= 0, got {n!r}")
    return n


def first_blocks(n: int, recipe: Recipe = None, *, block: str = BLOCK) -> Policy:
    """Blocks 0..n-1 in `recipe` (default BF16). block: the path format of block i (default "blocks/{i}")."""
    return _blocks(range(_count(n, "first_blocks")), BF16() if recipe is None else recipe, block)


def last_blocks(n: int, recipe: Recipe = None, *, num_blocks: int, block: str = BLOCK) -> Policy:
    """The last n of `num_blocks` blocks in `recipe` (default BF16).

    Raises:
      ValueError: n > num_blocks.
    """
    n, num_blocks = _count(n, "last_blocks"), _count(num_blocks, "last_blocks")
    if n > num_blocks:
        raise ValueError(f"last_blocks: {n} blocks of {num_blocks}")
    return _blocks(range(num_blocks - n, num_blocks), BF16() if recipe is None else recipe, block)


def last_fraction(fraction: float, recipe: Recipe = None, *, num_blocks: int, block: str = BLOCK) -> Policy:
    """The last ceil(fraction * num_blocks) blocks in `recipe` (default BF16); fraction in [0, 1]."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"last_fraction: fraction must be in [0, 1], got {fraction}")
    return last_blocks(math.ceil(fraction * num_blocks - 1e-9), recipe, num_blocks=num_blocks, block=block)


def mlp_only(recipe: Recipe = None, *, mlp: str = "*/mlp") -> Policy:
    """Only the MLPs quantized (they keep the default / their own recipe); every other layer in `recipe` (default
    BF16). mlp: the pattern of the MLP layers (default "*/mlp": any module named mlp and its sublayers)."""
    return Policy((Rule(mlp, None), Rule("*", BF16() if recipe is None else recipe)))


def exclude(names: Iterable[str] | str, recipe: Recipe = None) -> Policy:
    """The layers matching each pattern of `names` in `recipe` (default BF16)."""
    names = [names] if isinstance(names, str) else list(names)
    return Policy(tuple(Rule(n, BF16() if recipe is None else recipe) for n in names))


def _decided(policy: Policy, path: str) -> Recipe | None:
    """The recipe `policy` gives the layer at `path` (None: it keeps its own), without recording it."""
    rule = policy.match(path)
    return rule.recipe if rule is not None and rule.recipe is not None else policy.default


def block_segments(policies: Policy | Iterable[Policy], num_blocks: int, sublayers: Iterable[str], *,
                   block: str = BLOCK) -> tuple[tuple[int, int], ...]:
    """The contiguous runs [start, stop) of blocks 0..num_blocks-1 within which every layer gets the same recipe
    under each of `policies` (e.g. the phases of a `jax_fp4.schedule.PrecisionSwitch`): the segments a scanned block
    stack splits into so that each scan runs one recipe per layer. ``last_blocks(4, num_blocks=24)`` gives
    ((0, 20), (20, 24)); a policy without per-block rules ((0, num_blocks),).

    Args:
      policies: a `Policy` or several (a run's phases: a boundary of any of them is a boundary).
      num_blocks: the number of blocks (>= 1).
      sublayers: the paths of the quantizable layers inside one block, relative to it ("qkv", "mlp/up", ...; "" is
        the block itself). Rules are matched against "<block path>/<sublayer>" (and its ancestors, as always).
      block: the path format of block i (default "blocks/{i}").

    Raises:
      ValueError: num_blocks < 1.
    """
    pols = (policies,) if isinstance(policies, Policy) else tuple(policies)
    n = _count(num_blocks, "block_segments")
    if n < 1:
        raise ValueError("block_segments: num_blocks must be >= 1, got 0")
    subs = list(sublayers) or [""]

    def recipes_of(i: int) -> tuple:
        base = block.format(i=i)
        return tuple(_decided(p, f"{base}/{s}" if s else base) for p in pols for s in subs)

    starts = [0] + [i for i in range(1, n) if recipes_of(i) != recipes_of(i - 1)]
    return tuple(zip(starts, starts[1:] + [n], strict=True))
