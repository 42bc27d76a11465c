"""`Fp4Provider`: a qwix `QuantizationProvider` that runs the intercepted GEMMs with jax_fp4 recipes.

Routing. qwix calls the provider for every ``jax.lax.dot_general``, ``jax.numpy.einsum`` and ``jax.lax.ragged_dot``
made inside a quantized model (and, for ``jnp.einsum``, not for the dot_generals it makes itself). The provider
finds the first `Fp4Rule` whose ``module_path`` regex fully matches the calling module's qwix path
("blocks/0/mlp/up" in NNX, the Linen ``module.path`` joined by "/") and whose ``op_names`` (empty: all three)
contain the op, takes the rule's recipe (a `Recipe`, a recipe name, or a `jax_fp4.policy.Policy` resolved on that
path), and runs

  dot_general  `jax_fp4.flax.make_dot_general(recipe)` (the drop-in dot_general of the layers: same bits)
  einsum       `jax_fp4.flax.einsum.make_einsum(recipe)` (every contraction through the above)
  ragged_dot   `jax_fp4.ragged_dot`, with the groups padded to the recipe's wgrad block (`ragged.aligned_ragged_dot`)

A call no rule matches, a BF16 recipe, ``conv_general_dilated`` (not intercepted here) and the calls jax_fp4 makes
itself (its GEMMs' own lax.dot_general, also where JAX traces a custom VJP's forward rule lazily, as under
jax.checkpoint) run unchanged.

Stochastic-rounding keys (recipes with ``needs_key``, e.g. NVFP4's gradient dy) come from the rng collection
``rng_collection`` (default "quantize", the collection of jax_fp4's layers):
  Linen: ``self.make_rng("quantize")`` of the calling module, one per GEMM call, as `make_dot_general` draws them:
    ``model.apply(variables, x, rngs={"quantize": key})``.
  NNX: ``module.qwix_rngs["quantize"]``, qwix's rng attribute, which `qwix.quantize_model` clears after its
    initializing call: ``set_rngs(model, nnx.Rngs(quantize=seed))`` afterwards (one stream shared by every module,
    advanced per GEMM call as state under nnx.jit / nnx.grad; or an nnx.Rngs per module, e.g. a per-block one in
    a scanned stack). Draws follow `jax_fp4.flax.nnx_layers.draw_key`: forward-only calls whose
    fprop rounds deterministically leave the stream alone.

Shapes a recipe cannot block raise `jax_fp4.blocking.BlockingError` naming the op, the module path and the fixes,
unless the rule says ``on_unblockable="bf16"``: the op then runs unquantized, after one `UnquantizedOpWarning`.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import flax.linen as nn
import jax.numpy as jnp
import qwix
from flax import nnx
from jax import lax
from qwix._src.utils import flax_util

from jax_fp4 import blocking
from jax_fp4.blocking import BlockingError
from jax_fp4.flax.dot_general import _linen_key, make_dot_general
from jax_fp4.flax.einsum import make_einsum
from jax_fp4.flax.nnx_layers import differentiated, draw_key
from jax_fp4.policy import Policy, path_str
from jax_fp4.qwix.ragged import aligned_ragged_dot
from jax_fp4.recipes import Recipe, resolve

__all__ = ["Fp4Rule", "Fp4Provider", "UnquantizedOpWarning", "OPS", "set_rngs"]

OPS = ("dot_general", "einsum", "ragged_dot")
_ON_UNBLOCKABLE = ("raise", "bf16")


class UnquantizedOpWarning(UserWarning):
    """An op a rule matched that runs unquantized (a rule's ``on_unblockable="bf16"`` fall-back, or a form jax_fp4
    does not quantize), reported once per (op, module path, reason)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp4Rule(qwix.QuantizationRule):
    """A qwix rule naming a jax_fp4 recipe.

    Args (keywords):
      module_path: regex fully matched against the calling module's path (qwix's key; default ".*").
      op_names: the ops the rule applies to, a subset of ("dot_general", "einsum", "ragged_dot"); empty: all.
      recipe: a `jax_fp4.recipes.Recipe`, its name (`recipes.by_name`, stored as the Recipe), or a
        `jax_fp4.policy.Policy` (a block selection such as ``policy.last_blocks(2, num_blocks=8)`` with a default),
        resolved per module path when the op is traced.
      on_unblockable: "raise" (default): shapes the recipe cannot block raise `BlockingError`; "bf16": such an op
        runs unquantized (one `UnquantizedOpWarning` per op and path).

    qwix's own quantization fields (weight_qtype, act_qtype, tile_size, ...) do not apply: the recipe fixes every
    operand's format. Raises TypeError / ValueError at construction for a bad recipe, op name or on_unblockable.
    """

    recipe: Recipe | str | Policy | None = None
    on_unblockable: str = "raise"

    def __post_init__(self):
        if isinstance(self.recipe, str):
            object.__setattr__(self, "recipe", resolve(self.recipe, "Fp4Rule"))
        if not isinstance(self.recipe, (Recipe, Policy)):
            raise TypeError(f"Fp4Rule({self.module_path!r}): recipe must be a jax_fp4 Recipe, a recipe name or a "
                            f"jax_fp4.policy.Policy, got {type(self.recipe).__name__} {self.recipe!r}")
        bad = [op for op in self.op_names if op not in OPS]
        if bad:
            raise ValueError(f"Fp4Rule({self.module_path!r}): op_names {bad} are not ops this provider handles {OPS}")
        if self.on_unblockable not in _ON_UNBLOCKABLE:
            raise ValueError(f"Fp4Rule({self.module_path!r}): on_unblockable must be one of {_ON_UNBLOCKABLE}, got "
                             f"{self.on_unblockable!r}")
        used = [f for f in ("weight_qtype", "act_qtype", "tile_size", "act_static_scale")
                if getattr(self, f) is not None]
        if used:
            raise ValueError(f"Fp4Rule({self.module_path!r}): qwix's {used} do not apply (the recipe names every "
                             "operand's format); leave them unset")


_REPORTED: set = set()

# Modules whose frames sit between an op's caller and the provider (qwix's interception, JAX's own wrappers).
_TRANSPARENT = ("qwix", "jax", "jaxlib", "functools", "contextlib", "opt_einsum")


def _called_by_jax_fp4() -> bool:
    """Whether the intercepted op was called by jax_fp4 itself (its quantized GEMMs call lax.dot_general, and JAX
    traces a custom VJP's forward rule lazily, e.g. under jax.checkpoint, outside the provider's own call), as
    opposed to by the model: the first frame above the provider that is neither qwix's nor JAX's decides."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "jax_fp4" or name.startswith("jax_fp4."):
            return not name.startswith("jax_fp4.qwix")
        if name.split(".")[0] not in _TRANSPARENT:
            return False
        frame = frame.f_back
    return False


def _report(op: str, path: str, reason: str) -> None:
    if (op, path, reason) not in _REPORTED:
        _REPORTED.add((op, path, reason))
        warnings.warn(f"jax_fp4.qwix: {op} of module {path!r} runs unquantized: {reason}", UnquantizedOpWarning,
                      stacklevel=4)


def _qwix_fix(path: str) -> str:
    return (f". With qwix: an earlier Fp4Rule(module_path={path!r}, recipe='bf16'), or on_unblockable='bf16' on "
            "the rule that matched")


def set_rngs(model, rngs, *, where=None):
    """Give the modules of a quantized NNX `model` the stochastic-rounding rng source `rngs` (an ``nnx.Rngs`` with
    the provider's collection, e.g. ``nnx.Rngs(quantize=0)``): sets qwix's ``qwix_rngs`` attribute (as data, so
    nnx.jit / nnx.grad / nnx.scan carry its state) on every module, or on those whose path (a tuple of keys from
    ``nnx.iter_modules(model)``) satisfies ``where(path)``. Returns `model`."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"set_rngs: rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    for path, module in nnx.iter_modules(model):
        if where is None or where(path):
            module.qwix_rngs = nnx.data(rngs)
    return model


class Fp4Provider(qwix.QuantizationProvider):
    """A qwix provider running the GEMMs its `Fp4Rule`s match with jax_fp4 recipes (module docstring).

    Args:
      rules: `Fp4Rule`s in order of precedence (the first match wins).
      rng_collection: the Flax rng collection of the stochastic-rounding keys (default "quantize").
      strict: as `make_dot_general`: False (default) runs the forms jax_fp4 does not quantize (non-floating operands,
        matrix-vector products) unquantized with a warning; True raises ValueError for them.
      disable_jit: qwix's option (run the intercepted methods without jax.jit).

    Use: ``qwix.quantize_model(model, provider, *inputs)`` (NNX; ``skip_nnx_init=True`` is fine, the provider
    creates no variables) or ``qwix.quantize_model(model, provider)`` (Linen).

    Raises:
      TypeError: a rule that is not an `Fp4Rule`.
    """

    def __init__(self, rules, *, rng_collection: str = "quantize", strict: bool = False, disable_jit: bool = False):
        self.rng_collection = rng_collection
        self.strict = strict
        super().__init__(rules, disable_jit=disable_jit)

    def _init_rule(self, rule):
        if not isinstance(rule, Fp4Rule):
            raise TypeError(f"Fp4Provider: rules must be jax_fp4.qwix.Fp4Rule (a rule naming a recipe), got "
                            f"{type(rule).__name__} {rule!r}")
        return rule

    def get_intercept_map(self):
        return super().get_intercept_map() | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }

    # ---- rule, path and key of the calling module ---------------------------------------------------------------
    def _lookup(self, op: str):
        """(recipe or None, rule, module path) of an intercepted `op` in the calling module."""
        rule, _ = self._get_current_rule_and_op_id(op, only_rule=True)
        path = path_str(tuple(map(str, flax_util.get_current_module_path())))
        if rule is None:
            return None, None, path
        recipe = rule.recipe.resolve(path) if isinstance(rule.recipe, Policy) else rule.recipe
        return recipe, rule, path

    def _nnx_key(self, recipe: Recipe, operands, op: str, path: str):
        """The key of an NNX call (None in Linen: `make_dot_general` / `make_einsum` draw from the collection)."""
        module = flax_util.get_current_module()
        if isinstance(module, nn.Module) or not recipe.needs_key:
            return None
        source = getattr(module, "qwix_rngs", None)
        if source is None:
            if recipe.fprop_needs_key or differentiated(*operands):
                raise ValueError(f"jax_fp4.qwix: {op} of module {path!r}: recipe {recipe.name!r} rounds "
                                 "stochastically and needs keys: give the quantized model an rng stream, "
                                 f"jax_fp4.qwix.set_rngs(model, nnx.Rngs({self.rng_collection}=seed))")
            return None
        return draw_key(recipe, source, self.rng_collection, operands, f"jax_fp4.qwix {op} ({path})")

    def _guarded(self, rule: Fp4Rule, op: str, path: str, quantized, plain):
        try:
            return quantized()
        except BlockingError as e:
            if rule.on_unblockable == "bf16":
                _report(op, path, f"its shapes cannot be blocked ({e.details['bad'] if e.details else e})")
                return plain()
            if e.details is None:
                raise
            d = dict(e.details, layer=path, where=f"jax_fp4.qwix {op}")
            raise BlockingError(blocking.message(**d) + _qwix_fix(path), d) from None

    # ---- the intercepted ops ------------------------------------------------------------------------------------
    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                    out_sharding=None):
        """`jax.lax.dot_general` through `make_dot_general(recipe)` where a rule matches (module docstring)."""
        def plain():
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, out_sharding=out_sharding)

        if _called_by_jax_fp4():
            return plain()
        recipe, rule, path = self._lookup("dot_general")
        if recipe is None or not recipe.quantized:
            return plain()
        key = self._nnx_key(recipe, (lhs, rhs), "dot_general", path)
        fn = make_dot_general(recipe, strict=self.strict, rng_collection=self.rng_collection)
        return self._guarded(rule, "dot_general", path, lambda: fn(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding, key=key), plain)

    def einsum(self, subscripts, *operands, precision=None, preferred_element_type=None,
               _dot_general=lax.dot_general, out_sharding=None, **kwargs):
        """`jax.numpy.einsum` through `make_einsum(recipe)` where a rule matches; a caller's ``_dot_general`` is
        replaced by the recipe's (as qwix's own providers do)."""
        def plain():
            return jnp.einsum(subscripts, *operands, precision=precision,
                              preferred_element_type=preferred_element_type, _dot_general=_dot_general,
                              out_sharding=out_sharding, **kwargs)

        if _called_by_jax_fp4():
            return plain()
        recipe, rule, path = self._lookup("einsum")
        if recipe is None or not recipe.quantized:
            return plain()
        key = self._nnx_key(recipe, operands, "einsum", path)
        fn = make_einsum(recipe, strict=self.strict, rng_collection=self.rng_collection)
        if out_sharding is not None:
            kwargs["out_sharding"] = out_sharding
        return self._guarded(rule, "einsum", path, lambda: fn(
            subscripts, *operands, key=key, precision=precision, preferred_element_type=preferred_element_type,
            **kwargs), plain)

    def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                   **kwargs):
        """`jax.lax.ragged_dot` through `jax_fp4.ragged_dot` where a rule matches; the groups are padded to the
        recipe's wgrad block (`aligned_ragged_dot`), so router-sized groups train. ``group_offset`` (a shard of
        the groups) is not supported: such calls run unquantized with a warning (ValueError with strict=True)."""
        def plain():
            return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type, group_offset=group_offset, **kwargs)

        if _called_by_jax_fp4():
            return plain()
        recipe, rule, path = self._lookup("ragged_dot")
        if recipe is None or not recipe.quantized:
            return plain()
        if group_offset is not None or kwargs.get("out_sharding") is not None:
            reason = "group_offset / out_sharding are not supported by jax_fp4.ragged_dot"
            if self.strict:
                raise ValueError(f"jax_fp4.qwix: ragged_dot of module {path!r}: {reason}")
            _report("ragged_dot", path, reason)
            return plain()
        module = flax_util.get_current_module()
        if isinstance(module, nn.Module):
            key = _linen_key(self.rng_collection) if recipe.needs_key else None
        else:
            key = self._nnx_key(recipe, (lhs, rhs), "ragged_dot", path)

        def quantized():
            if jnp.ndim(lhs) == 2 and jnp.ndim(rhs) == 3:  # (other ranks: jax_fp4.ragged_dot's shape error)
                k, n = jnp.shape(rhs)[1:]
                diff = differentiated(lhs, rhs) is True
                m = blocking.needs(recipe, differentiated=True)["M"]  # the tokens: padded by aligned_ragged_dot
                blocking.check(recipe, m, k, n, differentiated=diff, where="jax_fp4.ragged_dot")
            y = aligned_ragged_dot(lhs, rhs, group_sizes, recipe=recipe, key=key)
            return y if preferred_element_type is None else y.astype(preferred_element_type)

        return self._guarded(rule, "ragged_dot", path, quantized, plain)

