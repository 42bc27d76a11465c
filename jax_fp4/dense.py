"""Quantized `dense` and `dot_general` with a custom VJP following a `Recipe` (jax_fp4.recipes).

Forward: x is quantized once (rowwise for fprop, columnwise for wgrad: one kernel launch, e.g. the mixed NVFP4-row /
MXFP8-column pass), the weight once (columnwise for fprop, rowwise for dgrad), and y = x @ w runs as a
`scaled_dot_general`. The residuals are the *quantized* wgrad x and dgrad w (not bfloat16 copies), tagged with
`jax.ad_checkpoint.checkpoint_name` ("jax_fp4_x_wgrad", "jax_fp4_w_dgrad") for remat policies.
Backward: dy is quantized once for both GEMMs (rowwise for dgrad, columnwise for wgrad) with the bias gradient fused
into the same pass; dx = dy @ w.T and dw = x.T @ dy.
Randomness (stochastic rounding): `key` is split into (x, w, dy) keys with `jax.random.split(key, 3)`.
Routes (`jax_fp4.route.recipe_routes`, per GEMM, at trace time): on the `jf4_gemm` kernel ("kernel") every
quantized operand stays a packed QuantizedArray (codes, block scales, tensor / window amax) and
fprop, dgrad and wgrad run `jf4_gemm`, fprop with the bias fused into its epilogue; no bfloat16 operand is written
and no dequantize pass runs. Emulated GEMMs (CPU; any device with implementation="emulated"): an operand consumed at
once (not a residual) comes from the quantize pass as an `ExactOperand` (bfloat16 value(q) * block scale, written by
the same kernel launch), so no dequantize pass runs for it: fprop's x and w, and both dy operands. The residuals
stay quantized. The bits of every emulated product are those of `scaled_dot_general` on the QuantizedArrays
(on CUDA devices up to the summation order: `_exact_gemm` writes these GEMMs so that they run on cuBLAS).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_fp4 import blocking as _blocking
from jax_fp4._src.dimension_numbers import canonical_dimension_numbers
from jax_fp4._src.emulation.layer_gemm import FPROP, exact_gemm
from jax_fp4._src.vjp_util import dtype_tag, operand_keys, refuse_forward_mode, reverse_mode_only
from jax_fp4.distributed import fsdp_axes, gather_quantized, reduces_in_output_dtype
from jax_fp4.gemm import ExactOperand, exact_operand, scaled_dot_general
from jax_fp4.quantize import quantize_rowwise_columnwise
from jax_fp4.recipes import Recipe, resolve
from jax_fp4.route import recipe_routes
from jax_fp4.validation import check_amax, check_key

__all__ = ["dense", "dot_general", "RESIDUAL_NAMES", "IMPLEMENTATIONS", "gemm_routes"]

#: dense's `implementation` choices: per GEMM as `jax_fp4.route.gemm_route` says, every quantized GEMM emulated, or
#: on jf4_gemm.
IMPLEMENTATIONS = ("auto", "emulated", "kernel")

RESIDUAL_NAMES = ("jax_fp4_x_wgrad", "jax_fp4_w_dgrad")
_FPROP = FPROP  # x[M, K] . w[K, N]
_DGRAD = (((1,), (1,)), ((), ()))  # dy[M, N] . w[K, N] over N
_WGRAD = (((0,), (0,)), ((), ()))  # x[M, K] . dy[M, N] over M


def _exact_ok(fmt, wanted) -> bool:
    """Whether an orientation is returned as an ExactOperand: wanted (consumed at once by an emulated GEMM) and a
    format whose block scales factor out of the product (not 1x64, not unquantized)."""
    return wanted and fmt is not None and fmt.exact_operand_ok


def _quantize_pair(a, row_fmt, col_fmt, key, dbias=False, exact=(False, False), amax=None):
    """(rowwise, columnwise, dbias) of a 2-D a; an unquantized orientation is `a` itself; amax: a's tensor amax
    from its producer (`quantize_rowwise_columnwise`'s amax) or None."""
    if row_fmt is None and col_fmt is None:
        db = jnp.sum(a.astype(jnp.float32), axis=0) if dbias else None
        return a, a, db
    ex = (_exact_ok(row_fmt, exact[0]), _exact_ok(col_fmt, exact[1]))
    row, col, db = quantize_rowwise_columnwise(a, row_fmt, col_fmt, key=key, dbias=dbias, exact=ex, amax=amax)
    return (a if row is None else row), (a if col is None else col), db


def _uses_x_amax(recipe) -> bool:
    """Whether one of x's quantizations (fprop x, wgrad x) encodes with the plain tensor amax (NVFP4 without RHT)."""
    return any(f is not None and f.has_tensor_amax and not f.rht for f in (recipe.fprop_x, recipe.wgrad_x))


def gemm_routes(recipe: Recipe, implementation: str = "auto") -> dict:
    """`jax_fp4.route.recipe_routes` for dense's implementations: {"fprop", "dgrad", "wgrad": "kernel", "native",
    "emulated" or "bf16"} on the default device.

    implementation="kernel" puts every GEMM whose formats `jf4_gemm` takes on the kernel (NVFP4 1x64 pairs only with
    1x64; the others stay emulated) and raises ValueError on a device without it; "emulated" emulates every
    quantized GEMM. Raises ValueError for an unknown implementation.
    """
    recipe = resolve(recipe, "dense.gemm_routes")  # a Recipe or its name
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"dense: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return recipe_routes(recipe, implementation)


def _gemm(a, b, dn, route, out_dtype=jnp.float32, bias=None, reduce_out=False):
    """One GEMM of the layer in float32 (+ bias in float32), cast to out_dtype. reduce_out: an emulated product's
    cross-shard sum runs in out_dtype (`jax_fp4.distributed`, reduce_dtype="output")."""
    if isinstance(a, ExactOperand) or isinstance(b, ExactOperand) or (reduce_out and route == "emulated"):
        return _exact_gemm(a, b, dn, out_dtype, bias, reduce_out)
    if hasattr(a, "fmt"):
        if route == "kernel":  # the bias and the cast in the kernel's epilogue
            return scaled_dot_general(a, b, dn, out_dtype, implementation="kernel", bias=bias)
        y = scaled_dot_general(a, b, dn, jnp.float32, implementation=route)
    else:
        y = lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _exact_gemm(a, b, dn, out_dtype, bias, reduce_out=False):
    """An emulated GEMM of dense over exact operands (ExactOperands, or QuantizedArrays turned into theirs): the
    form `jax_fp4._src.emulation.layer_gemm.exact_gemm` writes (+ bias in float32, one cast to out_dtype;
    reduce_out: the sharded contraction summed in out_dtype)."""
    ops = [o if isinstance(o, ExactOperand) else exact_operand(lax.optimization_barrier(o)) for o in (a, b)]
    (va, ta), (vb, tb) = ops
    return exact_gemm(va, ta, vb, tb, dn, out_dtype, bias, reduce_out)


def _window_pad(fmt, n: int) -> int:
    """Zero rows / columns that make n a multiple of the 1x64 encode's 64 (0 for other formats)."""
    return -n % fmt.window_size if fmt is not None and fmt.local_1x64 else 0


class _Routes(NamedTuple):
    """The route of each of dense's GEMMs (`gemm_routes`), computed once per call and carried through the custom
    VJP as a static argument."""
    fprop: str
    dgrad: str
    wgrad: str


def _forward(recipe, routes, x2, w, bias, key, x_amax=None):
    """y alone: only the fprop operands are quantized (no wgrad x, no dgrad w, no residuals).

    An NVFP4 1x64 fprop operand needs its non-block axis (x's M, w's N) to be a multiple of 64; a forward-only call
    pads it with zero rows / columns and drops their outputs. The 1x64 windows lie along K, within one row of x or
    one column of w, so the padding changes no other row's or column's codes, scales or window amax.
    """
    M, N = x2.shape[0], w.shape[1]
    _blocking.check(recipe, M, x2.shape[1], N, differentiated=False)  # names the operand, dimension and fixes
    pm, pn = _window_pad(recipe.fprop_x, M), _window_pad(recipe.fprop_w, N)
    if pm or pn:
        x2, w = jnp.pad(x2, ((0, pm), (0, 0))), jnp.pad(w, ((0, 0), (0, pn)))
        bias = None if bias is None else jnp.pad(bias, (0, pn))
    kx, kw, _ = operand_keys(key)
    ex = routes.fprop == "emulated"
    x_fprop, _, _ = _quantize_pair(x2, recipe.fprop_x, None, kx, exact=(ex, False), amax=x_amax)
    _, w_fprop, _ = _quantize_pair(w, None, recipe.fprop_w, kw, exact=(False, ex and not fsdp_axes(recipe)))
    y = _fprop_gemm(recipe, routes, x_fprop, w_fprop, jnp.result_type(x2, w), bias)
    return y[:M, :N] if pm or pn else y


def _fprop_gemm(recipe, routes, x_fprop, w_fprop, out_dtype, bias):
    """The fprop GEMM of the quantized operands on its route; FSDP: w's shards' codes and scales gathered first."""
    w_fprop = gather_quantized(w_fprop, fsdp_axes(recipe))
    return _gemm(x_fprop, w_fprop, _FPROP, routes.fprop, out_dtype, bias, reduces_in_output_dtype(recipe))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense(recipe, routes, x2, w, bias, key, x_amax):
    return _forward(recipe, routes, x2, w, bias, key, x_amax)


def _dense_fwd(recipe, routes, x2, w, bias, key, x_amax):
    _blocking.check(recipe, x2.shape[0], x2.shape[1], w.shape[1], differentiated=True)
    kx, kw, kdy = operand_keys(key)  # (the fprop key was checked by `dense`; dY's by the backward)
    ex = routes.fprop == "emulated"
    if _window_pad(recipe.fprop_x, x2.shape[0]) or _window_pad(recipe.fprop_w, w.shape[1]):
        # NVFP4 1x64 fprop operands padded to 64 rows / columns (`_forward`); the backward operands unpadded, each
        # orientation quantized on its own (the same bits as one quantize_rowwise_columnwise call with these keys)
        y = _forward(recipe, routes, x2, w, bias, key)
        _, x_wgrad, _ = _quantize_pair(x2, None, recipe.wgrad_x, kx)
        w_dgrad, _, _ = _quantize_pair(w, recipe.dgrad_w, None, kw)
    else:
        x_fprop, x_wgrad, _ = _quantize_pair(x2, recipe.fprop_x, recipe.wgrad_x, kx, exact=(ex, False),
                                             amax=x_amax)
        w_dgrad, w_fprop, _ = _quantize_pair(w, recipe.dgrad_w, recipe.fprop_w, kw,
                                             exact=(False, ex and not fsdp_axes(recipe)))
        # the residual w_dgrad stays sharded under FSDP (gathered in the bwd)
        y = _fprop_gemm(recipe, routes, x_fprop, w_fprop, jnp.result_type(x2, w), bias)
    res = (jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[0]), x_wgrad),
           jax.tree.map(partial(checkpoint_name, name=RESIDUAL_NAMES[1]), w_dgrad),
           kdy, dtype_tag(x2), dtype_tag(w), None if bias is None else dtype_tag(bias))
    return y, res


def _dense_bwd(recipe, routes, res, dy):
    x_wgrad, w_dgrad, kdy, xs, ws, bs = res
    # Checked here, not in the forward rule: jax.jvp also runs the forward rule, and must end in the forward-mode
    # TypeError (reverse_mode_only), not in this one.
    recipe.check_key(kdy, "dense", backward=True)
    has_bias = bs is not None
    dy_dgrad, dy_wgrad, db = _quantize_pair(dy, recipe.dgrad_dy, recipe.wgrad_dy, kdy, dbias=has_bias,
                                            exact=(routes.dgrad == "emulated", routes.wgrad == "emulated"))
    red = reduces_in_output_dtype(recipe)
    dx = _gemm(dy_dgrad, gather_quantized(w_dgrad, fsdp_axes(recipe)), _DGRAD, routes.dgrad, xs.dtype,
               reduce_out=red)
    dw = _gemm(x_wgrad, dy_wgrad, _WGRAD, routes.wgrad, ws.dtype, reduce_out=red)
    dbias = db.astype(bs.dtype) if has_bias else None
    return dx, dw, dbias, None, None


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x, kernel, bias=None, *, recipe: Recipe, key=None, implementation: str = "auto", x_amax=None):
    """y = x @ kernel + bias with the GEMMs quantized as `recipe` says (custom VJP, see the module docstring).

    Args:
      x: bfloat16/float16/float32 [..., K]; the tokens M = prod(x.shape[:-1]).
      kernel: [K, N] (same float dtypes).
      bias: [N] or None.
      recipe: a `jax_fp4.recipes.Recipe` or its name (`recipes.by_name`); BF16 runs plain `lax.dot_general`,
        exactly like flax's Linear.
      key: PRNG key for stochastic rounding: required when an fprop operand rounds stochastically, and when the
        call is differentiated with a recipe that rounds a gradient operand stochastically (e.g. `recipes.NVFP4()`);
        a forward-only call of such a recipe needs none.
      implementation: "auto" (each GEMM on the route `jax_fp4.route.gemm_route` names: the `jf4_gemm` kernel on
        compute capability 9.x for NVFP4 1x64 pairs, else native or emulated), "emulated" (every quantized GEMM
        emulated, e.g. to compare routes) or "kernel" (ValueError where no `jf4_gemm` kernel runs); see `gemm_routes`.
      x_amax: None, or x's tensor amax from the op that produced x: ``jnp.max(jnp.abs(x))`` (a float scalar; NaN when
        x holds a NaN), which XLA fuses into that op. The quantizations of x with a tensor scale and no RHT (NVFP4
        fprop x; the nvfp4 recipe's RHT wgrad x keeps its own pass) use it instead of re-reading x for the tensor
        amax and the NaN flag; results as without it, see `jax_fp4.quantize_rowwise_columnwise`'s amax. The Flax
        Dense layers take it too (``x_amax``). Whether it saves time depends on the producer: XLA's fused reduction
        can cost more than the amax pass it removes (docs/performance.md, "Tensor amax from the producer").
        Ignored where no quantization of x has a tensor scale (and by the BF16 recipe).

    Forward-only calls (no VJP taken: inference, `jax.jit` without `grad`) quantize only the fprop operands (x
    rowwise, w along K), so they carry no wgrad / dgrad shape constraint (e.g. MXFP8's M % 32 of the columnwise x)
    and write no residuals. An NVFP4 1x64 fprop operand's M or N that is not a multiple of 64 is padded with zeros,
    forward-only or differentiated (rows of x / columns of w are encoded independently, so the other outputs are
    unchanged); the backward operands keep their own constraints.
    Differentiated calls (`jax.grad`, `jax.vjp`) run the custom VJP. Forward-mode
    differentiation (`jax.jvp`, `jax.jacfwd`, `jax.hessian`) is not supported: it raises TypeError saying so.

    Returns:
      [..., N] in the promoted dtype of x and kernel, as `lax.dot_general` gives (the quantized GEMMs accumulate in
      float32 and add the bias in float32 before the one cast; BF16 adds it after, as flax's Linear does).

    Raises:
      ValueError: shapes that do not line up, a missing key, or shapes the recipe's formats cannot block
      (`jax_fp4.blocking.BlockingError`, e.g. MXFP8 wgrad needs M % 32 == 0 when differentiated, NVFP4 needs K and
      N % 16 == 0: the message names each GEMM operand role (fprop x / w, dgrad dy / w, wgrad x / dy), the
      dimension, and the fixes: padding, the recipes that do block the sizes, a policy rule; the Flax layers add
      their module path).
      TypeError: a recipe that is neither a Recipe nor a known name; forward-mode differentiation.
    """
    recipe = resolve(recipe, "dense")
    routes = _Routes(**gemm_routes(recipe, implementation))  # once per call; an unknown implementation, or "kernel"
    # without the kernel: ValueError
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"dense: x {x.dtype}{list(x.shape)} and kernel {kernel.dtype}{list(kernel.shape)} do not "
                         "line up (x [..., K], kernel [K, N])")
    if bias is not None and jnp.shape(bias) != (kernel.shape[1],):
        raise ValueError(f"dense: bias shape {jnp.shape(bias)} != ({kernel.shape[1]},)")
    if recipe.quantized:  # before the key check: one error whatever the key
        refuse_forward_mode("jax_fp4.dense", x, kernel, bias)
    recipe.check_key(key, "dense", backward=False)  # (a non-key is refused under BF16 too)
    if x_amax is not None:
        check_amax(x_amax, x, "dense: x_amax")
    if not _uses_x_amax(recipe):
        x_amax = None  # (no reduction is kept alive for a recipe that does not read it)
    if not recipe.quantized:
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    if x_amax is not None:  # the amax of x as the quantizer sees it: x's dtype (rounding is monotonic), float32
        x_amax = lax.stop_gradient(jnp.asarray(x_amax).astype(x.dtype).astype(jnp.float32))
    y = reverse_mode_only(_dense, "jax_fp4.dense")(recipe, routes, x2, kernel, bias, key, x_amax)
    return y.reshape(*lead, kernel.shape[1])


def _check_multi_axis_contraction(recipe, sizes, dimension_numbers):
    """BlockingError unless every block along the flattened K lies within the last contracting axis (its size a
    multiple of the recipe's K block): a block spanning several entries of an outer contracting axis (e.g. heads x
    head_dim with head_dim < the block) would share one block scale across them."""
    k_block = _blocking.needs(recipe, differentiated=True)["K"]
    if sizes[-1] % k_block:
        raise _blocking.BlockingError(
            f"dot_general: the contracting axes of sizes {tuple(sizes)} (dimension numbers {dimension_numbers}) "
            f"flatten into one K, and recipe {recipe.name}'s blocks of {k_block} along K must each lie within the "
            f"last contracting axis, whose size {sizes[-1]} is not a multiple of {k_block} (a block would span "
            "entries of the outer contracting axes, e.g. several heads). Fixes: contract the outer axes as batch "
            "axes (one GEMM each, then sum), order the contracting axes so that the last one holds whole blocks, "
            "or a recipe with smaller blocks")


def dot_general(x, w, dimension_numbers, *, recipe: Recipe, key=None, implementation: str = "auto"):
    """`lax.dot_general(x, w, dimension_numbers)` with the GEMMs quantized as `recipe` says (custom VJP of `dense`).

    Any dimension numbers: x is transposed to (batch, free, contracting) and w to (batch, contracting, free) (no
    transpose when the axes are already there, e.g. x[..., K1, K2] . w[K1, K2, N...], DenseGeneral's form), the
    contracting axes are flattened into one K axis (the block axis) in x's axis order, whatever order the dimension
    numbers list the pairs in (so x[..., H, D] contracted over (H, D) or (D, H), e.g. by jnp.einsum, blocks along
    D); every block lies within x's last contracting axis: its size must be a multiple of the recipe's K block,
    `jax_fp4.blocking.needs(recipe, differentiated=True)["K"]`, else BlockingError), the free axes into M and N,
    and the batch axes into one axis B over which `jax.vmap` maps `dense` (one NVFP4 tensor scale per batch element;
    with stochastic rounding, batch element b uses jax.random.split(key, B)[b]).

    Args:
      x, w: float arrays; w needs at least one free axis (N), x may have none (M = 1).
      dimension_numbers: ((x_contracting, w_contracting), (x_batch, w_batch)) as `lax.dot_general`.
      recipe, key, implementation: as `dense`.

    Returns:
      `lax.dot_general`'s layout (batch, x free, w free) in the promoted dtype of x and w.

    Raises:
      ValueError: a dimension outside its operand's rank, unpaired or repeated dimensions, no contracting
      dimension, w without a free axis, non-floating operands; and the errors of `dense`.
    """
    check_key(key, "dot_general")
    recipe = resolve(recipe, "dot_general")
    x, w = jnp.asarray(x), jnp.asarray(w)
    (cl, cr), (bl, br) = canonical_dimension_numbers(dimension_numbers, x.ndim, w.ndim)
    if len(cl) > 1:  # K flattens in x's axis order, whatever order the pairs are listed in (jnp.einsum's is its own)
        cl, cr = (tuple(a) for a in zip(*sorted(zip(cl, cr, strict=True)), strict=True))
    if not cl or w.ndim == len(cr) + len(br):
        raise ValueError(f"dot_general: {x.shape} . {w.shape} with {dimension_numbers}: needs a contracting dimension "
                         "and a free dimension of w")
    for d0, d1 in zip(cl + bl, cr + br, strict=True):
        if x.shape[d0] != w.shape[d1]:
            raise ValueError(f"dot_general: x dimension {d0} ({x.shape[d0]}) != w dimension {d1} ({w.shape[d1]}) in "
                             f"{x.shape} . {w.shape} with {dimension_numbers}")
    lf = [d for d in range(x.ndim) if d not in cl and d not in bl]
    rf = [d for d in range(w.ndim) if d not in cr and d not in br]
    if [*bl, *lf, *cl] != list(range(x.ndim)):
        x = jnp.transpose(x, (*bl, *lf, *cl))
    if [*br, *cr, *rf] != list(range(w.ndim)):
        w = jnp.transpose(w, (*br, *cr, *rf))
    if len(cl) > 1 and recipe.quantized:
        _check_multi_axis_contraction(recipe, list(x.shape[x.ndim - len(cl):]), dimension_numbers)
    bshape = x.shape[:len(bl)]
    mshape = x.shape[len(bl):x.ndim - len(cl)]
    nshape = w.shape[len(br) + len(cr):]
    K, N, B = math.prod(x.shape[x.ndim - len(cl):]), math.prod(nshape), math.prod(bshape)
    if not bl:
        y = dense(x.reshape(*mshape, K), w.reshape(K, N), recipe=recipe, key=key, implementation=implementation)
        return y.reshape(*mshape, *nshape)
    x3, w3 = x.reshape(B, *mshape, K), w.reshape(B, K, N)
    if key is None:
        y = jax.vmap(lambda a, b: dense(a, b, recipe=recipe, implementation=implementation))(x3, w3)
    else:
        y = jax.vmap(lambda a, b, k: dense(a, b, recipe=recipe, key=k, implementation=implementation))(
            x3, w3, jax.random.split(key, B))
    return y.reshape(*bshape, *mshape, *nshape)
