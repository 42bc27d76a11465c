"""Precision switch: train with one recipe, then change to another at a step or a fraction of training.

The NVFP4 paper (arXiv 2509.25149, appendix D) finds most of the quantization error in the forward pass and closes
the loss gap by switching to higher precision for roughly the last 10 % of training (torchtitan #3914 switches the
forward GEMMs before the learning-rate decay; TransformerEngine users ask for it in TE issue #2569).

`PrecisionSwitch(at, to, scope)`:
  at     an int >= 0: the first step (0-based) trained after the switch; or a float in (0, 1): that fraction of the
         total steps, the switch step being round(at * total_steps)
  to     the `Recipe` to switch to (e.g. `recipes.BF16()` or `recipes.MXFP8()`), or its name ("bf16")
  scope  "fwd": only the fprop operands (x and w of y = x @ w) take `to`'s formats, the dgrad / wgrad operands keep
         theirs; "all": every GEMM becomes `to`
Layers whose recipe is unquantized (BF16, e.g. kept so by a `jax_fp4.policy.Policy`) stay unquantized.

A training loop keeps two phases, each a `Policy` (`phases`) applied to the same model: the recipes are static
attributes of the module definition, so each phase is its own compiled step over the *same* state, selected on the
host by the step number (`phase`); the one recompilation happens at the switch. Checkpoints need no more than the
step (the phase follows from it); `describe` gives a record of the phase for the checkpoint metadata.
"""

from __future__ import annotations

import dataclasses

from jax_fp4.policy import Policy
from jax_fp4.recipes import Recipe, resolve

__all__ = ["PrecisionSwitch", "SCOPES"]

SCOPES = ("fwd", "all")


@dataclasses.dataclass(frozen=True)
class PrecisionSwitch:
    """Switch the recipe at step `at` (int) or fraction `at` (float in (0, 1)) of training; see the module docstring.

    `to` may be a `Recipe` or its name (`recipes.by_name`: "bf16", "mxfp8", ...), stored as the Recipe.

    Raises (at construction):
      ValueError: a negative step, a fraction outside (0, 1), an unknown scope, an unknown recipe name.
      TypeError: `to` neither a Recipe nor a str.
    """

    at: int | float
    to: Recipe
    scope: str = "fwd"

    def __post_init__(self):
        if isinstance(self.at, bool) or not isinstance(self.at, (int, float)):
            raise ValueError(f"PrecisionSwitch: at must be a step (int) or a fraction (float), got {self.at!r}")
        if isinstance(self.at, int) and self.at < 0:
            raise ValueError(f"PrecisionSwitch: the switch step must be >= 0, got {self.at}")
        if isinstance(self.at, float) and not 0.0 < self.at < 1.0:
            raise ValueError(f"PrecisionSwitch: a fraction of training must be in (0, 1), got {self.at}")
        object.__setattr__(self, "to", resolve(self.to, "PrecisionSwitch (to)"))
        if self.scope not in SCOPES:
            raise ValueError(f"PrecisionSwitch: scope must be one of {SCOPES}, got {self.scope!r}")

    def switch_step(self, total_steps: int) -> int:
        """The first step (0-based) of the second phase."""
        return self.at if isinstance(self.at, int) else int(round(self.at * total_steps))

    def phase(self, step: int, total_steps: int) -> int:
        """0 before the switch, 1 from `switch_step` on (step 0-based)."""
        return int(step >= self.switch_step(total_steps))

    def recipe(self, recipe: Recipe) -> Recipe:
        """The recipe a layer with `recipe` (a Recipe or its name) uses after the switch (an unquantized recipe is
        kept)."""
        recipe = resolve(recipe, "PrecisionSwitch.recipe")
        if not recipe.quantized:
            return recipe
        if self.scope == "all":
            return self.to
        if (recipe.fprop_x, recipe.fprop_w) == (self.to.fprop_x, self.to.fprop_w):
            return recipe
        return dataclasses.replace(recipe, name=f"{recipe.name}+fwd-{self.to.name}", fprop_x=self.to.fprop_x,
                                   fprop_w=self.to.fprop_w)

    def phases(self, policy: Policy) -> tuple[Policy, Policy]:
        """(before, after): `policy` and the policy with every recipe switched.

        Raises:
          ValueError: the policy has no default (the layers' own recipes are not known to it).
        """
        if policy.default is None:
            raise ValueError("PrecisionSwitch.phases: the policy needs a default recipe (Policy.with_default)")
        return policy, policy.map(self.recipe)

    def describe(self, total_steps: int) -> str:
        what = "forward GEMMs" if self.scope == "fwd" else "all GEMMs"
        return f"{what} -> {self.to.name} from step {self.switch_step(total_steps)} of {total_steps}"
