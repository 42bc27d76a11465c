"""Precision control for train_lm.py: policy, switch and diagnostics flags, run names and MFU (the gaps over seeds:
lm_stats.py).

Flags (added to train_lm's parser by `add_arguments`):
  --bf16-first N / --bf16-last N / --bf16-last-fraction F   those transformer blocks in BF16
  --mxfp8-first N / --mxfp8-last N                          those blocks in MXFP8 (BF16 wins where both name one)
  --policy-mlp-only                                         only the MLPs quantized (attention projections BF16)
  --exclude PATTERN (repeatable)                            layers matching the glob / "re:" pattern in BF16
  --switch-at X --switch-to RECIPE --switch-scope fwd|all   switch the recipe at step X (int >= 1) or fraction X of
                                                            training (0 < X < 1): the forward GEMMs or all of them
  --diagnostics N                                           every N steps a diagnostics step (the same update) records
                                                            per-layer, per-operand quantization statistics
Per-block rules on scanned blocks split the stack into segments (one scan each). BF16 runs ignore the policy and the
switch (nothing to change), so "bf16" stays the baseline's name; other runs are named recipe+tag+tag (e.g.
"nvfp4-fwd-mxfp8-bwd+bf16-last1+switch0.9-bf16-fwd"), with "@s<seed>" under --seeds.
"""

from __future__ import annotations

import argparse
import re

from jax_fp4 import policy as qpolicy
from jax_fp4 import recipes
from jax_fp4.schedule import SCOPES, PrecisionSwitch

# Dense bfloat16 tensor-core peak (FLOP/s) by device kind (substring of jax's device_kind, first match wins).
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("B200", 2250e12), ("B300", 2250e12), ("A100", 312e12))


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind from PEAK_BF16 (NVIDIA datasheets, SXM unless named), None if unknown."""
    return next((v for k, v in PEAK_BF16 if k.lower() in device_kind.lower()), None)


def _fraction(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {s}")
    return v


def _switch_at(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if 0.0 < v < 1.0:
        return v
    if v >= 1 and v == int(v):
        return int(v)
    raise argparse.ArgumentTypeError(f"must be a fraction of training in (0, 1) or a step >= 1, got {s}")


def _count(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def _recipe(s):
    try:
        recipes.by_name(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def add_arguments(p: argparse.ArgumentParser):
    g = p.add_argument_group("precision policy, switch and diagnostics")
    g.add_argument("--bf16-first", type=_count, default=0, metavar="N", help="the first N blocks in bf16")
    g.add_argument("--bf16-last", type=_count, default=0, metavar="N", help="the last N blocks in bf16")
    g.add_argument("--bf16-last-fraction", type=_fraction, default=0.0, metavar="F",
                   help="the last ceil(F x layers) blocks in bf16")
    g.add_argument("--mxfp8-first", type=_count, default=0, metavar="N", help="the first N blocks in mxfp8")
    g.add_argument("--mxfp8-last", type=_count, default=0, metavar="N", help="the last N blocks in mxfp8")
    g.add_argument("--policy-mlp-only", action="store_true", help="quantize the MLPs only (attention projections bf16)")
    g.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="layers matching this module-path glob (or re:REGEX) in bf16, e.g. '*/out' or 'blocks/0'")
    g.add_argument("--switch-at", type=_switch_at, metavar="X",
                   help="switch the recipe at fraction X of training (0 < X < 1) or at step X (>= 1)")
    g.add_argument("--switch-to", type=_recipe, metavar="RECIPE",
                   help="the recipe after the switch (default bf16; any name recipes.by_name knows)")
    g.add_argument("--switch-scope", choices=SCOPES, help="fwd: the forward GEMMs only (default); all: every GEMM")
    g.add_argument("--diagnostics", type=_count, default=0, metavar="N",
                   help="every N steps record per-layer quantization statistics (diagnostics.csv, heatmap PNGs)")
    g.add_argument("--seeds", type=int, nargs="+", metavar="S",
                   help="run every configuration once per seed (same seeds for all) and report the mean and spread "
                        "of each gap to bf16")


def block_flags(args) -> bool:
    return any((args.bf16_first, args.bf16_last, args.bf16_last_fraction, args.mxfp8_first, args.mxfp8_last))


def check(parser, args, layers: int):
    """parser.error for inconsistent flags."""
    for flag in ("bf16_first", "bf16_last", "mxfp8_first", "mxfp8_last"):
        if getattr(args, flag) > layers:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} exceeds the {layers} blocks")
    if args.switch_at is None and (args.switch_to or args.switch_scope):
        parser.error("--switch-to / --switch-scope need --switch-at")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: repeated seeds")
    for pat in args.exclude:
        try:
            qpolicy.Rule(pat, None)
        except ValueError as e:
            parser.error(f"--exclude: {e}")


def make_policy(args, recipe, layers: int) -> qpolicy.Policy:
    """The policy of the flags with `recipe` as its default (the exclusions first, then the bf16 blocks, the mxfp8
    blocks, MLP-only)."""
    pol = qpolicy.Policy()
    for pat in args.exclude:
        pol += qpolicy.exclude(pat)
    pol += qpolicy.first_blocks(args.bf16_first) + qpolicy.last_blocks(args.bf16_last, num_blocks=layers)
    pol += qpolicy.last_fraction(args.bf16_last_fraction, num_blocks=layers)
    pol += qpolicy.first_blocks(args.mxfp8_first, recipes.MXFP8())
    pol += qpolicy.last_blocks(args.mxfp8_last, recipes.MXFP8(), num_blocks=layers)
    if args.policy_mlp_only:
        pol += qpolicy.mlp_only()
    return pol.with_default(recipe)


def make_switch(args) -> PrecisionSwitch | None:
    if args.switch_at is None:
        return None
    return PrecisionSwitch(args.switch_at, recipes.by_name(args.switch_to or "bf16"), args.switch_scope or "fwd")


def run_name(recipe_name: str, args, seed: int | None = None) -> str:
    """The run's name (curves, summary, checkpoints/<name>): the recipe and the precision-control tags."""
    tags = []
    if recipe_name != "bf16":
        tags += [f"excl-{p}" for p in args.exclude]
        tags += [f"bf16-first{args.bf16_first}"] * bool(args.bf16_first)
        tags += [f"bf16-last{args.bf16_last}"] * bool(args.bf16_last)
        tags += [f"bf16-last{args.bf16_last_fraction:g}frac"] * bool(args.bf16_last_fraction)
        tags += [f"mxfp8-first{args.mxfp8_first}"] * bool(args.mxfp8_first)
        tags += [f"mxfp8-last{args.mxfp8_last}"] * bool(args.mxfp8_last)
        tags += ["mlp-only"] * args.policy_mlp_only
        if args.switch_at is not None:
            tags.append(f"switch{args.switch_at:g}-{args.switch_to or 'bf16'}-{args.switch_scope or 'fwd'}")
    name = re.sub(r"[^A-Za-z0-9._@+-]+", "_", "+".join([recipe_name, *tags]))
    return name if seed is None else f"{name}@s{seed}"
