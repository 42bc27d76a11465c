"""`lax.dot_general` dimension numbers: checked, normalized, and the product's shape (shared by
`scaled_dot_general`, `jax_fp4.dense.dot_general` and `jax_fp4.flax.make_dot_general`)."""

from __future__ import annotations

__all__ = ["canonical_dimension_numbers", "product_shape", "check_dot_shapes"]


def canonical_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """((cl, cr), (bl, br)) as tuples of non-negative ints.

    Raises:
      ValueError: a dimension outside its operand's rank (no modulo wrapping), a repeated dimension, or contracting
      / batch lists of different lengths.
    """
    try:
        (cl, cr), (bl, br) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
                         f"rhs_batch)), got {dimension_numbers!r}") from None
    out = []
    for dims, nd, side in ((cl, lhs_ndim, "lhs contracting"), (cr, rhs_ndim, "rhs contracting"),
                           (bl, lhs_ndim, "lhs batch"), (br, rhs_ndim, "rhs batch")):
        dims = tuple(int(d) for d in dims)
        for d in dims:
            if not -nd <= d < nd:
                raise ValueError(f"dot_general: {side} dimension {d} is out of range for an operand of rank {nd} "
                                 f"(dimension numbers {dimension_numbers})")
        out.append(tuple(d % nd for d in dims))
    cl, cr, bl, br = out
    if len(cl) != len(cr) or len(bl) != len(br):
        raise ValueError(f"dot_general: contracting / batch dimensions do not pair up: {dimension_numbers}")
    if len(set(cl + bl)) != len(cl + bl) or len(set(cr + br)) != len(cr + br):
        raise ValueError(f"dot_general: a dimension is listed twice in {dimension_numbers}")
    return (cl, cr), (bl, br)


def product_shape(lhs_shape, rhs_shape, dn) -> tuple[int, ...]:
    """The shape of `lax.dot_general(lhs, rhs, dn)` for canonical dn: (batch, lhs free, rhs free)."""
    (cl, cr), (bl, br) = dn
    free_l = [lhs_shape[i] for i in range(len(lhs_shape)) if i not in cl and i not in bl]
    free_r = [rhs_shape[i] for i in range(len(rhs_shape)) if i not in cr and i not in br]
    return (*(lhs_shape[i] for i in bl), *free_l, *free_r)


def check_dot_shapes(dimension_numbers, lhs_shape, rhs_shape, where: str):
    """(canonical dimension numbers, product shape) of lhs . rhs, with tuple batch lists.

    Raises:
      ValueError (beginning with `where`): the errors of `canonical_dimension_numbers`; paired contracting or batch
      dimensions of different lengths.
    """
    (cl, cr), (bl, br) = canonical_dimension_numbers(dimension_numbers, len(lhs_shape), len(rhs_shape))
    for d0, d1 in zip(cl + bl, cr + br, strict=True):
        if lhs_shape[d0] != rhs_shape[d1]:
            raise ValueError(f"{where}: lhs dimension {d0} ({lhs_shape[d0]}) != rhs dimension {d1} ({rhs_shape[d1]}) "
                             f"for lhs shape {tuple(lhs_shape)} and rhs shape {tuple(rhs_shape)} with "
                             f"{dimension_numbers}")
    dn = ((cl, cr), (tuple(bl), tuple(br)))
    return dn, product_shape(lhs_shape, rhs_shape, dn)
