"""Applying a `jax_fp4.policy.Policy` to Flax models (NNX and Linen).

NNX (`apply`, `assignments`, `describe`): the layers are found with `nnx.iter_graph`; their path is the "/"-joined
attribute path ("blocks/3/mlp/up"). A scanned / vmapped stack has one path for all its blocks ("stacks/0/mlp/up"):
``stacks={"stacks/0": ("blocks/0", "blocks/1"), ...}`` says which blocks each stack holds, and its layers then
resolve as those blocks' layers ("blocks/0/mlp/up", "blocks/1/mlp/up"), which must agree
(`jax_fp4.policy.block_segments` gives the runs of blocks that do). Quantizable layers:
  * jax_fp4 layers with a recipe: `jax_fp4.flax.nnx.Dense` (also inside LayerNormDense / LayerNormMLP) and
    `jax_fp4.flax.moe.MoEMLP`; `apply` sets their ``recipe`` (a static attribute: the module definition changes, the
    state does not, so `nnx.split` gives a new graphdef and the same state);
  * with ``drop_in=True``, existing Flax layers with a ``dot_general`` attribute (`nnx.Linear`, `nnx.LinearGeneral`
    without a ``dot_general_cls``, the projections of `nnx.MultiHeadAttention`, ...): `apply` sets it to a drop-in
    dot_general of the recipe (`jax_fp4.flax.make_dot_general`; BF16 is plain `lax.dot_general`), and `nnx.Einsum`'s
    ``einsum_op`` to `jax_fp4.flax.einsum.make_einsum`'s. Only layers that some rule or the default reaches are
    changed; layers inside a jax_fp4 layer (MoEMLP's router, never quantized) are not candidates.
A model with no quantizable layer raises ValueError in `assignments`, `apply` and `describe` ("pass drop_in=True"
when it has drop-in layers only), rather than leaving it in full precision without a word.

Linen: pass the Policy as the ``recipe`` of `jax_fp4.flax.linen` layers (each resolves its recipe from its own
``self.path`` when traced), and use `linen_dot_general(policy)` as the ``dot_general`` of existing Linen layers
(`nn.Dense(..., dot_general=linen_dot_general(policy))`) inside `linen_module_paths()`, which tells it the calling
module's path. `describe_linen` traces ``module.init`` abstractly (no FLOPs) and returns the layer -> recipe table,
raising for a rule that matches nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
from flax import nnx

from jax_fp4.blocking import layer_note
from jax_fp4.flax import make_dot_general
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.moe import MoEMLP, group_alignment
from jax_fp4.flax.nnx import Dense
from jax_fp4.flax.nnx_layers import quantize_stream
from jax_fp4.policy import Policy, format_table, path_str, recording
from jax_fp4.recipes import Recipe

__all__ = ["apply", "assignments", "describe", "layers", "policy_paths", "PolicyDotGeneral", "PolicyEinsum",
           "linen_dot_general",
           "linen_module_paths", "describe_linen"]


@dataclasses.dataclass(frozen=True)
class PolicyDotGeneral:
    """A hashable drop-in ``dot_general`` of one recipe (`make_dot_general(recipe)` per call), so that a module's
    definition compares equal across `apply` calls with the same policy (no recompilation)."""

    recipe: Recipe

    def __call__(self, *args, **kwargs):
        return make_dot_general(self.recipe)(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class PolicyEinsum:
    """A hashable drop-in ``einsum_op`` of one recipe (`make_einsum(recipe)` per call) for `nnx.Einsum`."""

    recipe: Recipe

    def __call__(self, *args, **kwargs):
        return make_einsum(self.recipe)(*args, **kwargs)


def _is_fp4_layer(node) -> bool:
    return isinstance(node, (Dense, MoEMLP))


def _drop_in_attr(node) -> str | None:
    """The attribute a drop-in sets on `node`: "dot_general" (`nnx.Linear`, `nnx.LinearGeneral` without a
    ``dot_general_cls``, and other modules with a callable ``dot_general``), "einsum_op" (`nnx.Einsum`), or None."""
    if not isinstance(node, nnx.Module) or _is_fp4_layer(node):
        return None
    if isinstance(node, nnx.Einsum) or callable(getattr(node, "einsum_op", None)):
        return "einsum_op"
    if isinstance(node, nnx.LinearGeneral):
        return "dot_general" if getattr(node, "dot_general_cls", None) is None else None
    return "dot_general" if callable(getattr(node, "dot_general", None)) else None


def _is_drop_in(node) -> bool:
    return _drop_in_attr(node) is not None


def _current(node) -> Recipe | None:
    if _is_fp4_layer(node):
        return node.recipe
    fn = getattr(node, _drop_in_attr(node))
    return fn.recipe if isinstance(getattr(fn, "recipe", None), Recipe) else None


def layers(model, *, drop_in: bool = False) -> dict[str, nnx.Module]:
    """{path: layer} of the quantizable layers of an NNX model (see the module docstring), in graph order. Layers
    inside a jax_fp4 layer (MoEMLP's router) are the jax_fp4 layer's business and never drop-in candidates."""
    nodes = [(path_str(path), node) for path, node in nnx.iter_graph(model)]
    owners = [p for p, node in nodes if _is_fp4_layer(node)]
    found = {}
    for p, node in nodes:
        inside = any(p.startswith(o + "/") or o == "" for o in owners if o != p)
        if _is_fp4_layer(node) or (drop_in and _is_drop_in(node) and not inside):
            found[p] = node
    return {p: found[p] for p, _ in nodes if p in found}


def _nothing_to_act_on(model, drop_in: bool, what: str):
    """ValueError saying why `what` finds no quantizable layer in `model`, and the fix."""
    candidates = [] if drop_in else list(layers(model, drop_in=True))
    if candidates:
        shown = ", ".join(repr(p) for p in candidates[:4]) + (" ..." if len(candidates) > 4 else "")
        return ValueError(f"{what}: {type(model).__name__} has no jax_fp4 layer; its {len(candidates)} layers "
                          f"with a dot_general / einsum_op ({shown}) are quantized only as drop-ins: pass "
                          "drop_in=True")
    return ValueError(f"{what}: {type(model).__name__} has no quantizable layer (jax_fp4.flax.nnx.Dense / "
                      "LayerNormDense / LayerNormMLP, jax_fp4.flax.moe.MoEMLP, or with drop_in=True nnx.Linear / "
                      "nnx.LinearGeneral / nnx.Einsum and other modules with a dot_general)")


def policy_paths(path: str, stacks=None) -> list[str]:
    """The paths the rules see for the layer at `path`: [path], or for a layer inside a stack of `stacks` ({stack
    path: block paths}, the longest matching stack path wins) the same layer in each of the stack's blocks."""
    for prefix in sorted(stacks or {}, key=len, reverse=True):
        if path == prefix or path.startswith(prefix + "/"):
            return [b + path[len(prefix):] for b in stacks[prefix]]
    return [path]


def _resolve_stacked(policy: Policy, path: str, names: list[str], current):
    found = {policy.resolve(q, current) for q in names}
    if len(found) > 1:
        raise ValueError(f"policy: the stacked layer {path!r} holds {', '.join(names)}, which the policy gives "
                         f"different recipes ({', '.join(sorted(r.name for r in found))}); split the stack where "
                         "jax_fp4.policy.block_segments says")
    return found.pop()


def assignments(policy: Policy, model, *, drop_in: bool = False, check: bool = True,
                stacks=None) -> dict[str, Recipe | None]:
    """{path: recipe} that `apply` would set (None: a drop-in layer left unchanged: no rule and no default reaches it).

    stacks: {stack path: block paths} of the model's scanned stacks (see the module docstring); None: none.

    Raises:
      UnmatchedRuleError (check=True): a rule matches no quantizable layer (stacked layers count as their blocks').
      ValueError: a stacked layer's blocks get different recipes; the model has no quantizable layer (the message
      says "pass drop_in=True" when only drop-in layers, e.g. nnx.Linear, are there). `apply` and `describe` raise
      the same.
    """
    return _assign(policy, model, layers(model, drop_in=drop_in), drop_in=drop_in, check=check, stacks=stacks)


def _assign(policy: Policy, model, found: dict, *, drop_in: bool, check: bool, stacks) -> dict[str, Recipe | None]:
    """`assignments` over the layers `found` (one walk of the model, shared with `apply` and `describe`)."""
    names = {p: policy_paths(p, stacks) for p in found}
    if check:
        policy.check([q for qs in names.values() for q in qs],
                     "the model" + ("" if drop_in else " (layers with a dot_general count with drop_in=True)"))
    if not found:  # a policy that would silently leave the model in full precision
        raise _nothing_to_act_on(model, drop_in, "jax_fp4.flax.policy")
    out = {}
    for p, node in found.items():
        if _is_fp4_layer(node):
            out[p] = _resolve_stacked(policy, p, names[p], node.recipe)
        else:
            rules = [policy.match(q) for q in names[p]]
            reached = any(r is not None and r.recipe is not None for r in rules) or policy.default is not None
            out[p] = (_resolve_stacked(policy, p, names[p], _current(node)) if reached or _current(node) is not None
                      else None)
    return out


def apply(policy: Policy, model, *, drop_in: bool = False, rngs: nnx.Rngs | None = None,
          check: bool = True, stacks=None) -> dict[str, Recipe | None]:
    """Set every quantizable layer's recipe as `policy` says (in place); returns `assignments`.

    Args:
      policy: the `Policy`.
      model: an NNX module (call outside `jax.jit`, before `nnx.split`; split again afterwards for the new graphdef).
      drop_in: also set the ``dot_general`` of existing layers (nnx.Linear, ...).
      rngs: seeds a stochastic-rounding stream (``rngs[layer.rng_collection]``) for a jax_fp4 layer whose new recipe
        needs a key and that has none (built with a deterministic recipe). The state then gains that stream.
      check: raise for a rule that matches no layer.
      stacks: {stack path: block paths} of the model's scanned stacks (see the module docstring).

    Raises:
      UnmatchedRuleError: see `assignments`; ValueError: a stacked layer's blocks get different recipes.
      ValueError: a layer's new recipe needs a stochastic-rounding key, the layer has no stream and `rngs` is None
        (or the layer is a scanned / vmapped stack, whose stream must be stacked: build it with such a recipe).
    """
    found = layers(model, drop_in=drop_in)
    out = _assign(policy, model, found, drop_in=drop_in, check=check, stacks=stacks)
    for p, recipe in out.items():
        node = found[p]
        if recipe is None:
            continue
        if not _is_fp4_layer(node):
            if recipe != _current(node):
                attr = _drop_in_attr(node)
                setattr(node, attr, (PolicyEinsum if attr == "einsum_op" else PolicyDotGeneral)(recipe))
            continue
        if recipe == node.recipe:
            continue
        if recipe.needs_key and node.rngs is None:
            stacked = _stack_axes(node) > 0
            if rngs is None or stacked:
                raise ValueError(f"policy.apply: layer {p!r} gets recipe {recipe.name!r}, which uses stochastic "
                                 "rounding, but was built with a deterministic recipe (no rng stream); "
                                 + ("build the stack with a stochastic-rounding recipe" if stacked else
                                    "pass rngs=nnx.Rngs(quantize=seed) to apply"))
            node.rngs = quantize_stream(recipe, rngs, node.rng_collection, f"policy.apply({p!r})")
        if isinstance(node, MoEMLP) and node.alignment % group_alignment(recipe):
            node.alignment = math.lcm(node.alignment, group_alignment(recipe))
        node.recipe = recipe
    return out


def _stack_axes(node) -> int:
    """How many leading axes a jax_fp4 layer's weights carry beyond its own (a layer of a scanned / vmapped stack
    holds one weight per block): `Dense`'s kernel is [in, out], `MoEMLP`'s expert kernels [E, in, out]."""
    if isinstance(node, Dense):
        return node.kernel[...].ndim - 2
    return node.up.kernel[...].ndim - 3


def _rule_name(policy: Policy, path: str, recipe, stacks=None) -> str:
    rule = policy.match(policy_paths(path, stacks)[0])
    if rule is not None:
        return repr(rule.pattern)
    if recipe is None:
        return "(unchanged)"
    return "default" if policy.default is not None else "(own recipe)"


def describe(policy: Policy, model, *, drop_in: bool = False, check: bool = True, stacks=None) -> str:
    """The layer -> recipe table of `policy` on an NNX model (and the rule that decided each layer; a stacked
    layer's: that of its first block)."""
    found = layers(model, drop_in=drop_in)
    out = _assign(policy, model, found, drop_in=drop_in, check=check, stacks=stacks)
    return format_table((p, "-" if r is None else r.name, _rule_name(policy, p, r, stacks) + _block_note(found[p], r))
                        for p, r in out.items())


def _block_note(node, recipe) -> str:
    """"  ! ..." when the layer's kernel [K, N] cannot be blocked by its recipe, or by any recipe
    (`jax_fp4.blocking.layer_note`); "" otherwise, or when the layer does not say its K and N."""
    k, n = getattr(node, "in_features", None), getattr(node, "out_features", None)
    if not isinstance(k, (int, tuple, list)) or not isinstance(n, (int, tuple, list)):
        return ""
    K, N = (math.prod(v) if isinstance(v, (tuple, list)) else v for v in (k, n))
    note = layer_note(recipe if recipe is not None else _current(node), K, N)
    return f"  ! {note}" if note else ""


# ---- Linen -----------------------------------------------------------------------------------------------------------
_LINEN_PATH: contextvars.ContextVar[str | None] = contextvars.ContextVar("jax_fp4_linen_path", default=None)


def _interceptor(next_fun, args, kwargs, context):
    token = _LINEN_PATH.set(path_str(context.module.path))
    try:
        return next_fun(*args, **kwargs)
    finally:
        _LINEN_PATH.reset(token)


@contextlib.contextmanager
def linen_module_paths():
    """Within the block, `linen_dot_general` knows the path of the Linen module calling it (`nn.intercept_methods`).
    Wrap ``module.init`` / ``module.apply`` (inside the jitted function when jitting)."""
    import flax.linen as nn

    with nn.intercept_methods(_interceptor):
        yield


@dataclasses.dataclass(frozen=True)
class _LinenPolicyDotGeneral:
    policy: Policy

    def __call__(self, *args, **kwargs):
        path = _LINEN_PATH.get()
        if path is None:
            raise ValueError("linen_dot_general: call module.init / module.apply inside "
                             "jax_fp4.flax.policy.linen_module_paths() (the layer's path decides its recipe)")
        return make_dot_general(self.policy.resolve(path))(*args, **kwargs)


def linen_dot_general(policy: Policy):
    """A ``dot_general`` for existing Linen layers (nn.Dense, nn.DenseGeneral, ...) whose recipe comes from `policy`
    by the calling module's path; use inside `linen_module_paths()`. The policy needs a default (or rules covering
    every such layer): ValueError otherwise."""
    return _LinenPolicyDotGeneral(policy)


def describe_linen(policy: Policy, module, *args, check: bool = True, **kwargs) -> str:
    """The layer -> recipe table of `policy` in a Linen `module` (jax_fp4.flax.linen layers with the policy as their
    recipe, and layers using `linen_dot_general(policy)`), from an abstract ``module.init(key, *args, **kwargs)``.

    Raises:
      UnmatchedRuleError (check=True): a rule matches no layer. ValueError: no layer takes the policy.
    """
    with recording() as found, linen_module_paths():
        jax.eval_shape(lambda: module.init(jax.random.key(0), *args, **kwargs))
    seen = {}
    for pol, p, r in found:
        if pol == policy:
            seen.setdefault(p, r)
    if not seen:  # the policy reaches no layer: the model would train in full precision without a word
        raise ValueError(f"describe_linen: no layer of {type(module).__name__} takes the policy: pass it as the "
                         "recipe of jax_fp4.flax.linen layers (Dense, LayerNormDense, LayerNormMLP, Einsum), or use "
                         "dot_general=jax_fp4.flax.policy.linen_dot_general(policy) in existing Linen layers")
    if check:
        policy.check(seen, f"{type(module).__name__}")
    return format_table((p, r.name, _rule_name(policy, p, r)) for p, r in seen.items())
