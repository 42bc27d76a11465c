"""Input validation shared by the ops and the reference (`jax_fp4.reference` stays the numeric oracle; these checks
only decide what is a valid call). Every check raises ValueError at trace time naming the offending shape, dtype or
field; grouped sizes known at trace time are checked too (traced sizes are checked on the device, see
`jax_fp4.reference.grouped`).

Single tensors: `check_quantize_inputs`. Grouped tensors: `validate` (the representation, the group dims and their
alignment), `check_format`, `check_static_alignment`, `normalize_axis`.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp4.formats import MXFP8, NVFP4, Format

__all__ = [
    "Representation", "check_format", "check_key", "check_quantize_inputs", "check_static_alignment", "group_dims",
    "normalize_axis", "static_block_dim", "validate",
]

I32 = jnp.int32
_FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_quantize_inputs(x, fmt: Format, axis: int, key) -> int:
    """Trace-time validation of a quantize of x along `axis` to `fmt`; returns the normalized (negative) block axis.

    Raises:
      ValueError: fmt not a format spec; as `Format.validate` (dtype, rank, block alignment); stochastic rounding
      without a key. TypeError: a key that is not a JAX PRNG key (`check_key`), even for a deterministic format.
    """
    if not isinstance(fmt, Format):
        raise ValueError(f"quantize: fmt must be jax_fp4.NVFP4(...) or jax_fp4.MXFP8(...), got {fmt!r}")
    axis = fmt.validate(jnp.shape(x), jnp.result_type(x), axis)
    check_key(key, f"quantize {fmt!r}")
    if fmt.needs_key and key is None:
        raise ValueError(f"{fmt!r}: stochastic rounding needs a PRNG key (quantize(..., key=key)); x {jnp.shape(x)}")
    return axis


def check_amax(amax, x, where: str) -> None:
    """A caller's tensor amax of x (`jnp.max(jnp.abs(x))`): ValueError unless a float scalar."""
    if jnp.shape(amax) != () or not jnp.issubdtype(jnp.result_type(amax), jnp.floating):
        raise ValueError(f"{where} must be a float scalar (jnp.max(jnp.abs(x)) of x {jnp.result_type(x)}"
                         f"{list(jnp.shape(x))}), got {jnp.result_type(amax)}{list(jnp.shape(amax))}")


def check_key(key, where: str) -> None:
    """TypeError naming `where` when `key` is neither None nor a JAX PRNG key: a typed key (`jax.random.key(seed)`,
    dtype key<...>) or a raw uint32[..., 2] key (`jax.random.PRNGKey(seed)`). Checked whether or not the format
    rounds stochastically, so a wrong argument is never silently ignored."""
    if key is None:
        return
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return
    if dtype is not None and dtype == jnp.uint32 and tuple(jnp.shape(key))[-1:] == (2,):
        return
    got = f"{dtype}{list(jnp.shape(key))}" if dtype is not None else repr(key)
    raise TypeError(f"{where}: key must be None or a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__} "
                    f"{got}")


# ---- grouped tensors ---------------------------------------------------------------------------------------------
class Representation(enum.StrEnum):
    SAME_BOTH_DIMS = "SAME_BOTH_DIMS"
    VARYING_FIRST_DIM = "VARYING_FIRST_DIM"
    VARYING_LAST_DIM = "VARYING_LAST_DIM"
    VARYING_BOTH_DIMS = "VARYING_BOTH_DIMS"


def _concrete(a) -> np.ndarray | None:
    """a as numpy if its value is known at trace time (no tracer), else None."""
    if a is None or isinstance(a, jax.core.Tracer):
        return None
    try:
        return np.asarray(a)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _dims_array(a, name: str, n: int | None) -> jnp.ndarray:
    if jnp.ndim(a) != 1 or not jnp.issubdtype(jnp.result_type(a), jnp.integer):
        raise ValueError(f"grouped_quantize: {name} must be a 1-D integer array, got {jnp.result_type(a)}"
                         f"{list(jnp.shape(a))}")
    if n is not None and jnp.shape(a)[0] != n:
        raise ValueError(f"grouped_quantize: {name} has {jnp.shape(a)[0]} groups, expected {n}")
    return jnp.asarray(a).astype(I32)


def _representation(x_shape, first_dims, last_dims, num_groups):
    """(representation, N), validating the shape of x against it."""
    fd, ld = first_dims is not None, last_dims is not None
    rep = {(False, False): Representation.SAME_BOTH_DIMS, (True, False): Representation.VARYING_FIRST_DIM,
           (False, True): Representation.VARYING_LAST_DIM, (True, True): Representation.VARYING_BOTH_DIMS}[fd, ld]
    if rep is Representation.SAME_BOTH_DIMS:
        if not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"grouped_quantize: SAME_BOTH_DIMS (no first_dims/last_dims) needs a static "
                             f"num_groups >= 1, got {num_groups!r}")
        n = int(num_groups)
    else:
        dims = first_dims if fd else last_dims
        n = jnp.shape(dims)[0] if jnp.ndim(dims) == 1 else 0
        if n < 1:
            raise ValueError(f"grouped_quantize: first_dims/last_dims must be 1-D with >= 1 group, got shapes "
                             f"{jnp.shape(first_dims) if fd else None} / {jnp.shape(last_dims) if ld else None}")
        if num_groups is not None and num_groups != n:
            raise ValueError(f"grouped_quantize: num_groups={num_groups} but the dims arrays have {n} groups")
    want_nd = 1 if rep is Representation.VARYING_BOTH_DIMS else 2
    if len(x_shape) != want_nd:
        raise ValueError(f"grouped_quantize: {rep.value} needs a {want_nd}-D x, got shape {tuple(x_shape)}")
    if rep is Representation.SAME_BOTH_DIMS and x_shape[0] % n:
        raise ValueError(f"grouped_quantize: SAME_BOTH_DIMS x {tuple(x_shape)} rows not divisible by {n} groups")
    return rep, n


def group_dims(x_shape, rep, first_dims, last_dims, n):
    """int32[N] rows and cols of every group."""
    if rep is Representation.SAME_BOTH_DIMS:
        return jnp.full((n,), x_shape[0] // n, I32), jnp.full((n,), x_shape[1], I32)
    if rep is Representation.VARYING_FIRST_DIM:
        return _dims_array(first_dims, "first_dims", n), jnp.full((n,), x_shape[1], I32)
    if rep is Representation.VARYING_LAST_DIM:
        return jnp.full((n,), x_shape[0], I32), _dims_array(last_dims, "last_dims", n)
    return _dims_array(first_dims, "first_dims", n), _dims_array(last_dims, "last_dims", n)


def static_block_dim(x_shape, rep, n: int, colwise: bool) -> int | None:
    """The block-axis length every group shares when it is a static dimension of x (else None): K = x.shape[1]
    rowwise for SAME_BOTH_DIMS / VARYING_FIRST_DIM, M = x.shape[0] (// N for SAME_BOTH_DIMS) columnwise for
    SAME_BOTH_DIMS / VARYING_LAST_DIM."""
    if rep is Representation.SAME_BOTH_DIMS:
        return x_shape[0] // n if colwise else x_shape[1]
    if rep is Representation.VARYING_FIRST_DIM and not colwise:
        return x_shape[1]
    if rep is Representation.VARYING_LAST_DIM and colwise:
        return x_shape[0]
    return None


def check_static_alignment(x_shape, rep, n: int, colwise: bool, fmt: Format, what: str = "grouped_quantize"):
    """ValueError when the static block-axis length (`static_block_dim`) is not a multiple of the block size."""
    d = static_block_dim(x_shape, rep, n, colwise)
    if d is not None and d % fmt.block_size:
        side = "first dim M" if colwise else "last dim K"
        raise ValueError(f"{what} {fmt!r}: every group's {side} is {d} (x {tuple(x_shape)}, {rep.value}), not a "
                         f"multiple of the block size {fmt.block_size}")


def _check_sizes(x_shape, rep, first_dims, last_dims, n, colwise, bs, fmt):
    """Static / concrete checks: alignment of the block axis, negative sizes, groups overrunning the buffer."""
    what = "first dim M" if colwise else "last dim K"
    check_static_alignment(x_shape, rep, n, colwise, fmt)
    fd, ld = _concrete(first_dims), _concrete(last_dims)
    if (first_dims is not None and fd is None) or (last_dims is not None and ld is None):
        return  # traced sizes: checked on the device (misaligned groups are poisoned), see the module docstring
    if rep is Representation.SAME_BOTH_DIMS:
        return
    rows = fd if fd is not None else np.full(n, x_shape[0], np.int64)
    cols = ld if ld is not None else np.full(n, x_shape[1], np.int64)
    rows, cols = rows.astype(np.int64), cols.astype(np.int64)
    for g in range(n):
        if rows[g] < 0 or cols[g] < 0:
            raise ValueError(f"grouped_quantize: group {g} has negative dims [{rows[g]}, {cols[g]}]")
        blk = rows[g] if colwise else cols[g]
        if blk % bs:
            raise ValueError(f"grouped_quantize {fmt!r}: group {g} is [{rows[g]}, {cols[g]}]; its {what} = {blk} "
                             f"is not a multiple of the block size {bs}")
    total = int((rows * cols).sum())
    if total > math.prod(x_shape):
        raise ValueError(f"grouped_quantize: the groups hold {total} elements, more than x {tuple(x_shape)}")


def check_format(fmt, key, what: str = "grouped_quantize"):
    """ValueError for formats grouped quantize does not support, or stochastic rounding without a key."""
    if not isinstance(fmt, (NVFP4, MXFP8)):
        raise ValueError(f"{what}: fmt must be jax_fp4.NVFP4(...) or jax_fp4.MXFP8(...), got {fmt!r}")
    if fmt.scaling_2d or fmt.local_1x64:
        raise ValueError(f"{what}: {fmt!r} is not supported for grouped tensors (scaling_2d and local_1x64 are "
                         f"single-tensor only; for N same-shape tensors such as expert weights use "
                         f"jax.vmap(jax_fp4.quantize)); use NVFP4 1D (optionally rht / stochastic_rounding) or "
                         f"MXFP8")
    if key is not True:  # (ragged_dot checks the format alone with key=True)
        check_key(key, f"{what} {fmt!r}")
    if fmt.needs_key and key is None:
        raise ValueError(f"{what}: {fmt!r} needs a PRNG key ({what}(..., key=key))")


def normalize_axis(axis) -> int:
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"grouped_quantize: axis must be -1 (rowwise, blocks along each group's last dim) or 0 "
                         f"(columnwise, along its first dim), got {axis!r}")
    return -1 if axis % 2 else 0


def validate(x, fmt: Format, *, first_dims=None, last_dims=None, num_groups: int | None = None, axis: int = -1,
             key=None):
    """Trace-time (and concrete-size) validation of a grouped quantize: returns (x, representation, N, rows, cols,
    axis) with rows / cols the materialized int32[N] group dims. Raises ValueError as `grouped_quantize`."""
    check_format(fmt, key)
    x = jnp.asarray(x)
    first_dims, last_dims = (np.asarray(d) if isinstance(d, (list, tuple)) else d for d in (first_dims, last_dims))
    if jnp.dtype(x.dtype) not in _FLOAT_INPUTS:
        raise ValueError(f"grouped_quantize {fmt!r}: x must be bfloat16, float16 or float32, got {x.dtype}"
                         f"{list(x.shape)}")
    axis = normalize_axis(axis)
    rep, n = _representation(x.shape, first_dims, last_dims, num_groups)
    rows, cols = group_dims(x.shape, rep, first_dims, last_dims, n)
    _check_sizes(x.shape, rep, first_dims, last_dims, n, axis == 0, fmt.block_size, fmt)
    return x, rep, n, rows, cols, axis
