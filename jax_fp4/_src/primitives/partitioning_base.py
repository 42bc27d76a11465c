"""Mesh and PartitionSpec helpers of the sharding rules, and the lowering that routes a primitive through them.

`partitioning.py` (quantize, dequantize, swizzle, amax) and `partitioning_grouped.py` (the grouped primitives)
build their `custom_partitioning` rules from these; see the `partitioning.py` docstring for the rules themselves.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from jax_fp4._src import ffi as _ffi
from jax_fp4._src import jax_compat

__all__ = ["axis_names", "divisible_spec", "entry_names", "lowering", "mesh_size", "shard_index", "spec_entry",
           "spec_of", "split_factors"]


def entry_names(entry) -> tuple:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names), as a tuple."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def spec_entry(names):
    """The PartitionSpec entry of a sequence of mesh axis names (None, the one name, or a tuple)."""
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def spec_of(sharding, ndim):
    """The PartitionSpec of `sharding` as a tuple of `ndim` entries (None for unsharded or missing dims)."""
    spec = tuple(getattr(sharding, "spec", ())) if sharding is not None else ()
    return spec + (None,) * (ndim - len(spec))


def mesh_size(mesh, ax) -> int:
    """Number of devices along mesh axes `ax` (None, a name or a tuple of names)."""
    if ax is None:
        return 1
    axes = ax if isinstance(ax, tuple) else (ax,)
    return math.prod(mesh.shape[a] for a in axes)


def divisible_spec(mesh, shape, spec):
    """spec with every mesh axis dropped whose size does not divide its dimension."""
    return tuple(ax if ax is None or d % mesh_size(mesh, ax) == 0 else None for d, ax in zip(shape, spec, strict=True))


def axis_names(spec):
    """The mesh axis names a PartitionSpec tuple uses, in order."""
    out = []
    for ax in spec:
        if ax is not None:
            out.extend(ax if isinstance(ax, tuple) else (ax,))
    return tuple(out)


def split_factors(name, n, divisors, devices):
    """Shardy mappings of an axis of length n and of its divided lengths n / d (d in `divisors`, each dividing the
    next larger one): {1: mapping of n, d: mapping of n / d}, and the sizes of factors that never span a dimension.

    Compound factors tie the dimensions together, e.g. ("k", 256, {16, 64}) -> {64: "k0", 16: "(k0 k1)",
    1: "(k0 k1 k2)"}, {"k1": 4, "k2": 16}, so a sharding of x's K propagates to its K/16 scales and K/64 window
    amaxes. Only when every sharding of the axis fits whole into the major factor (n / max(d) a multiple of the
    device count, which every product of mesh axes divides); otherwise Shardy would split a mesh axis into sub-axes,
    which custom_partitioning cannot decode, so the divided dimensions get factors of their own instead."""
    levels = sorted(set(divisors), reverse=True)
    if not levels:
        return {1: name}, {}
    if devices is None or (n // levels[0]) % devices:
        return {1: name, **{d: f"{name}_{d}" for d in levels}}, {}
    parts = [f"{name}0"]
    maps, sizes = {levels[0]: parts[0]}, {}
    for i, (coarse, fine) in enumerate(zip(levels, [*levels[1:], 1], strict=True), 1):
        parts.append(f"{name}{i}")
        sizes[parts[-1]] = coarse // fine
        maps[fine] = "(" + " ".join(parts) + ")"
    return maps, sizes


def shard_index(mesh, ax):
    """int32 index of this shard along a dim sharded over mesh axes `ax` (None, a name or a tuple of names, major
    first, as in a PartitionSpec); 0 for an unsharded dim."""
    idx = jnp.zeros((), jnp.int32)
    for name in (() if ax is None else ax if isinstance(ax, tuple) else (ax,)):
        idx = idx * mesh.shape[name] + jax.lax.axis_index(name)
    return idx


def _single_device(ctx) -> bool:
    ac = ctx.module_context.axis_context
    return getattr(ac, "num_devices", 2) == 1 or (hasattr(ac, "device_assignment") and ac.device_assignment is None)


def _require_devices(prim) -> None:
    """Make jit pass the device assignment when lowering a jaxpr holding `prim` (as it does for custom_partitioning
    itself): without it the lowering context has no devices, `_single_device` is true and the sharding rule is
    skipped (the custom call would then run on gathered operands). A private jax hook: `jax_compat`."""
    jax_compat.require_devices_during_lowering(prim)


def lowering(prim, inner, partition):
    """A lowering rule for `prim`: `inner` for the per-shard (local=True) bind, else the custom_partitioning call.

    partition(prim, params, avals_in, avals_out, devices) returns the `custom_partitioning` function of one call
    (its per-shard body binds `prim` with local=True); `devices` is the device count of the lowering context."""
    _require_devices(prim)

    def rule(ctx, *args, local=False, **params):
        shape = ctx.avals_in[0].shape
        if local or not shape or 0 in shape or _single_device(ctx):  # nothing to partition
            return inner(ctx, *args, **params)
        devices = getattr(ctx.module_context.axis_context, "num_devices", None)
        f = partition(prim, params, ctx.avals_in, ctx.avals_out, devices)
        return mlir.lower_fun(lambda *a: f(*a), multiple_results=prim.multiple_results)(ctx, *args)

    return rule


def register_lowerings(prim, partition, reference, *, cuda=None, cpu=None):
    """Register `prim`'s lowering rules, each through `lowering(prim, ..., partition)` (the sharding rule).

    Args:
      reference: the default rule, on every platform (the jnp reference or emulation, `mlir.lower_fun`).
      cuda: the FFI lowering for platform "cuda", or None (no CUDA extension, or it lacks the target).
      cpu: the host handler's FFI lowering for platform "cpu", or None; inside `ffi.reference_lowering_on_cpu()`
        the CPU takes `reference` instead.
    """
    reference_rule = lowering(prim, reference, partition)
    mlir.register_lowering(prim, reference_rule)
    if cuda is not None:
        mlir.register_lowering(prim, lowering(prim, cuda, partition), platform="cuda")
    if cpu is not None:
        mlir.register_lowering(prim, _ffi.cpu_rule(lowering(prim, cpu, partition), reference_rule), platform="cpu")
