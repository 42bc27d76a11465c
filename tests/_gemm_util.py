"""Helpers of tests/test_gemm.py and tests/test_dense.py (and the latter's sharding subprocess): exact float64
decoding of QuantizedArrays straight from docs/numerics.md, float64 reference products, the error bounds the products
are compared with, and the dense layer's operand reproduction and check.

Error bound of a block-scaled GEMM (`gemm_bound`; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
section 3.1 and eq. 3.5). u = 2**-24 (fp32 unit roundoff), gamma_n = n u / (1 - n u); |theta_n| <= gamma_n stands for
a product of n factors (1 + delta_i)^(+-1), |delta_i| <= u.

  * Let a_k, b_k be the operands' exact values (`decode`: value(q) * s_b * amax * fp32(1/2688) for NVFP4, value(q) *
    s_b / S_enc,w for 1x64, float(q) * 2**(e-127) for MXFP8; the inverse RHT applied) and E = sum_k a_k b_k over the
    K contracted elements, A = sum_k |a_k b_k|.
  * The emulation sums terms t_k = a_k b_k / T in fp32, T the product of the NVFP4 tensor scales amax * fp32(1/2688)
    (T = 1 when no operand has one). NVFP4 and MXFP8 terms are exact (value(q) * s_b has <= 6 significant bits, a
    product of two <= 12 bits). 1x64 operands are fp32 dequantized values, one rounding each (the division by
    S_enc,w), and their fp32 product one more. An fp32 inner product of K terms computed in *any* order is within
    gamma_K * sum|x_k y_k| of the exact one (eq. 3.5), so with `op` operand roundings per term:
    |fl(S) - E/T| <= gamma_(K+op) * A/T.
  * Each NVFP4 tensor scale costs two roundings (fl(amax * fp32(1/2688)) and the multiplication of the fp32 result by
    it): R = fl(S) * T * (1 + theta_scale) with scale = 2 per NVFP4 operand (1x64 and MXFP8: none). Hence
        |R - E| <= (gamma_(K+op) + gamma_scale * (1 + gamma_(K+op))) * A.
  * RHT pairs (wgrad): the emulation multiplies the transformed operands a', b'; per 16-chunk H is orthogonal, so
    E = sum a'_k b'_k = sum a_k b_k, and the bound above holds with A' = sum |a'_k b'_k| in place of A.
  * The float64 reference (decoding: one fp64 rounding per value; the inverse RHT: four fp64 butterfly roundings;
    products and sums: at most K roundings) is within (K + 8) 2**-53 A, < 2**-40 A for K <= 2**12: `SLACK` * A.
  * `dequantize` (float32) instead of `decode` as the reference adds its roundings: NVFP4 1D/2D 3 per value
    ((s_b * amax) * fp32(1/2688), then value(q) * f), so |D_dq - E| <= gamma_6 A for two NVFP4 operands; 1x64 one
    per value (the fp32 values the emulation multiplies: gamma_2 A); MXFP8 none (exact). For RHT operands the
    inverse transform (4 fp32 butterfly stages, then the exact * 0.25 and signs) makes each element a sum of 16 terms
    +-a'_j / 4 with 3 + 4 = 7 roundings each: |a^_m - a_m| <= gamma_7 * alpha_m with
    alpha_m = sum_{j in chunk(m)} |a'_j| / 4 >= |a_m| (a' the transformed values, `chunk_l1`), so
    |D_dq - E| <= sum_m |a^_m - a_m| |b^_m| + |a_m| |b^_m - b_m| <= gamma_7 (2 + gamma_7) sum_m alpha_m beta_m
    (the emulation's own error stays relative to A' = sum |a'_m b'_m|).
  * Casting the fp32 result z to bfloat16 (RNE, u_bf16 = 2**-8) adds u_bf16 |z|; adding a bias in fp32 first adds
    u |z| (`cast_bound`).
  * The `jf4_gemm` kernel (`kernel_gemm_bound`) accumulates on the tensor cores, whose fp32 accumulation need not
    be IEEE RNE: on the generations measured, each MMA step aligns the exact products and the accumulator to the
    largest exponent and truncates the sum (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor
    cores", PeerJ CS 2021); the bound assumes that model, which also covers RNE accumulation. So
    each term is cut at most once when aligned and once when the step's sum is normalised, each a relative error
    below 2u (round toward zero): 4 units of u per term, gamma_(4K) in place of gamma_K. 1x64 pairs: each 64-window
    partial sum is multiplied by the two window decode factors (fp32 values, one rounding each from the exact
    factors, and two multiplications) before it enters the accumulator: 4 more roundings per term. The tensor
    scales cost the same 2 roundings per NVFP4 operand.
Every rounding above is relative (|delta| <= u) because the tests' data (random normal, magnitudes within a few
powers of two) keeps all intermediate values normal fp32 numbers. Nothing here is tuned to an observed error: every
factor is one of the rounding counts above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _quantize_util import split_quantize

import jax_fp4
from jax_fp4 import MXFP8, NVFP4

U = 2.0**-24  # fp32 unit roundoff
U_BF16 = 2.0**-8  # bfloat16 unit roundoff (8 significant bits)
SLACK = 2.0**-40  # all float64 steps of the reference, relative to A (see the module docstring)
INV_2688 = np.float32(1.0 / 2688.0)  # fp32(1/(6 * 448)), the NVFP4 decode-scale factor (docs/numerics.md section 1)


def gamma(n: int, u: float = U) -> float:
    return n * u / (1 - n * u)


def f64(a) -> np.ndarray:
    """float64 copy of an array of any float dtype (float4/float8 through ml_dtypes' float32 conversion)."""
    a = np.asarray(jax.device_get(a))
    return a.astype(np.float32).astype(np.float64) if a.dtype.itemsize < 4 else a.astype(np.float64)


def hadamard() -> np.ndarray:
    """H = diag(s) H16 / 4 (docs/numerics.md: Sylvester H16, s_i = -1 where bit i of 0xD7E8 is set), float64
    [16, 16]."""
    i = np.arange(16)
    h16 = np.where(np.array([[bin(a & b).count("1") % 2 for b in i] for a in i]), -1.0, 1.0)
    s = np.array([-1.0 if (0xD7E8 >> k) & 1 else 1.0 for k in i])
    return s[:, None] * h16 / 4


def decode(q, *, inverse_rht: bool = True) -> np.ndarray:
    """Exact float64 values of a QuantizedArray (compact or swizzled) in q.shape, straight from docs/numerics.md.

    Independent of `jax_fp4.dequantize`: ml_dtypes decodes the E2M1/E4M3/E5M2/E8M0 codes and the arithmetic is fp64
    (exact except one rounding of NVFP4's value * s_b * amax * fp32(1/2688) and 1x64's division, relative 2**-53).
    inverse_rht=False keeps RHT operands in the transformed domain.
    """
    q = jax_fp4.unswizzle_scales(q)
    fmt = q.fmt
    if isinstance(fmt, NVFP4):
        v = f64(q.data)  # block axis last
        s = np.repeat(f64(q.scale), fmt.block_size, axis=-1)
        if fmt.local_1x64:
            aw = np.asarray(q.window_amax, np.float32)
            with np.errstate(divide="ignore", over="ignore"):
                enc = np.float32(2688) / np.maximum(aw, np.float32(1e-12))  # fp32 RNE division, as specified
            enc = np.where(aw == 0, np.float32(1), np.minimum(enc, np.finfo(np.float32).max))
            d = v * s / np.repeat(enc.astype(np.float64), 64, axis=-1)
        else:
            d = v * s * float(q.amax) * float(INV_2688)
        if fmt.rht and inverse_rht:
            d = (d.reshape(*d.shape[:-1], -1, 16) @ hadamard().T).reshape(d.shape)
        return np.moveaxis(d, -1, q.axis)
    assert isinstance(fmt, MXFP8), fmt
    s = np.repeat(f64(q.scale), fmt.block_size, axis=q.axis)
    return f64(q.data) * s


def chunk_l1(a: np.ndarray, axis: int) -> np.ndarray:
    """alpha: for every element, the sum of |a| over its 16-chunk along `axis`, divided by 4 (the RHT's |H_ij|)."""
    m = np.moveaxis(np.abs(a), axis, -1)
    c = m.reshape(*m.shape[:-1], -1, 16).sum(-1, keepdims=True) / 4
    return np.moveaxis(np.broadcast_to(c, (*c.shape[:-1], 16)).reshape(m.shape), -1, axis)


def dot64(a: np.ndarray, b: np.ndarray, dimension_numbers):
    """(a . b, |a| . |b|) in float64 with `lax.dot_general`'s dimension numbers and output layout."""
    (ca, cb), (ba, bb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    sa = [next(letters) for _ in range(a.ndim)]
    sb = [next(letters) for _ in range(b.ndim)]
    for i, j in zip(list(ca) + list(ba), list(cb) + list(bb), strict=True):
        sb[j] = sa[i]
    out = [sa[i] for i in ba] + [sa[i] for i in range(a.ndim) if i not in ca and i not in ba]
    out += [sb[j] for j in range(b.ndim) if j not in cb and j not in bb]
    spec = f"{''.join(sa)},{''.join(sb)}->{''.join(out)}"
    return np.einsum(spec, a, b), np.einsum(spec, np.abs(a), np.abs(b))


def tensor_scale_roundings(*qs) -> int:
    """Roundings the NVFP4 tensor scales add to the emulated product: 2 per operand with a tensor amax."""
    return sum(2 for q in qs if isinstance(q.fmt, NVFP4) and not q.fmt.local_1x64)


def operand_roundings(*qs) -> int:
    """Roundings in each emulated operand value: 1x64 operands are rounded fp32 dequantized values."""
    return sum(1 for q in qs if isinstance(q.fmt, NVFP4) and q.fmt.local_1x64)


def gemm_bound(absprod: np.ndarray, K: int, *, op: int = 0, scale: int = 0) -> np.ndarray:
    """|R - E| bound of the emulated product (module docstring), plus the float64 reference's SLACK."""
    g = gamma(K + op)
    return (g + gamma(scale) * (1 + g) + SLACK) * absprod


def kernel_gemm_bound(absprod: np.ndarray, K: int, *, window: bool = False, scale: int = 0) -> np.ndarray:
    """|R - E| bound of the `jf4_gemm` kernel's product (module docstring): tensor-core accumulation, 4 roundings
    per term; `window` (a 1x64 pair) 4 more for the window decode factors."""
    g = gamma(4 * K + (4 if window else 0))
    return (g + gamma(scale) * (1 + g) + SLACK) * absprod


def operand_bound(a, b, dimension_numbers, K: int, *, kernel: bool = False):
    """(reference, bound) of scaled_dot_general(a, b) from the exact decoded operands; kernel=True: the bound of the
    `jf4_gemm` kernel's product (`kernel_gemm_bound`) instead of the emulated one's."""
    ref, absprod = dot64(decode(a), decode(b), dimension_numbers)
    if isinstance(a.fmt, NVFP4) and a.fmt.rht:  # E is the same, but A is the transformed domain's
        absprod = dot64(decode(a, inverse_rht=False), decode(b, inverse_rht=False), dimension_numbers)[1]
    if kernel:
        return ref, kernel_gemm_bound(absprod, K, window=a.fmt.local_1x64 and b.fmt.local_1x64,
                                      scale=tensor_scale_roundings(a, b))
    return ref, gemm_bound(absprod, K, op=operand_roundings(a, b), scale=tensor_scale_roundings(a, b))


def cast_bound(ref: np.ndarray, bound: np.ndarray, dtype, *, added_in_f32: bool = False) -> np.ndarray:
    """Bound after an optional fp32 addition (of an exact bias, `ref` including it) and the cast to `dtype`.

    z = fl(r + b) = (r + b)(1 + d), y = cast(z) = z (1 + e): |y - ref| <= bound (1+u)(1+e) + |ref| ((1+u)(1+e) - 1).
    """
    e = {jnp.dtype(jnp.bfloat16): U_BF16, jnp.dtype(jnp.float32): 0.0}[jnp.dtype(dtype)]
    f = (1 + (U if added_in_f32 else 0.0)) * (1 + e)
    return bound * f + np.abs(ref) * (f - 1)


def assert_within(got, ref: np.ndarray, bound: np.ndarray, what: str) -> None:
    """Every element of `got` finite and within `bound` of `ref`; on failure the worst element is reported."""
    g = f64(got)
    assert g.shape == ref.shape, f"{what}: shape {g.shape} != {ref.shape}"
    assert np.all(np.isfinite(g)), f"{what}: non-finite values"
    err = np.abs(g - ref)
    ratio = err / np.maximum(bound, np.finfo(np.float64).tiny)
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    assert ratio[i] <= 1.0, (
        f"{what}: {int(np.sum(ratio > 1))} of {ratio.size} elements outside the bound; worst at {i}: got {g[i]!r}, "
        f"reference {ref[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}"
    )


def violates(got, ref: np.ndarray, bound: np.ndarray) -> bool:
    """Whether some element of `got` lies outside `bound` of `ref` (the bound can reject a wrong product)."""
    return bool(np.any(np.abs(f64(got) - ref) > bound))


def documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """jax.nn.scaled_matmul's documented semantics (its docstring), for jax versions without a CPU lowering."""
    a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), lhs.shape[-1] // lhs_scales.shape[-1], -1)
    b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), rhs.shape[-1] // rhs_scales.shape[-1], -1)
    return jnp.einsum("bmk,bnk->bmn", a, b, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(preferred_element_type)


# ---- the dense layer: its GEMM operands, reproduced with the documented calls, and the fp64 checks -------------------
FPROP = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]
DGRAD = (((1,), (1,)), ((), ()))  # dy[M, N] . w[K, N] over N
WGRAD = (((0,), (0,)), ((), ()))  # x[M, K] . dy[M, N] over M


def dense_operands(x2, w, dy, key, recipe):
    """The six GEMM operands `dense` documents (jax_fp4/dense.py): key -> (kx, kw, kdy) = jax.random.split(key, 3);
    x2[M, K] rowwise for fprop and columnwise for wgrad, w[K, N] rowwise (blocks along N) for dgrad and columnwise
    for fprop, dy[M, N] rowwise for dgrad and columnwise for wgrad. dense quantizes each pair with one
    quantize_rowwise_columnwise(a, row_fmt, col_fmt, key=k), documented (and tested in test_quantize_ops.py) to
    equal quantize(a, row_fmt, axis=-1, key=split(k)[0]) and quantize(a, col_fmt, axis=0, key=split(k)[1]) bit for
    bit; those separate calls (`split_quantize`, one small jit per format, orientation and shape, shared with
    test_gemm.py) are used here."""
    kx, kw, kdy = jax.random.split(key, 3)
    x_fprop, x_wgrad = split_quantize(x2, recipe.fprop_x, recipe.wgrad_x, kx)
    w_dgrad, w_fprop = split_quantize(w, recipe.dgrad_w, recipe.fprop_w, kw)
    dy_dgrad, dy_wgrad = split_quantize(dy, recipe.dgrad_dy, recipe.wgrad_dy, kdy)
    return dict(x_fprop=x_fprop, w_fprop=w_fprop, dy_dgrad=dy_dgrad, w_dgrad=w_dgrad, x_wgrad=x_wgrad,
                dy_wgrad=dy_wgrad)


#: operand name -> (recipe field, block axis)
OPERAND_FIELDS = {"x_fprop": ("fprop_x", -1), "w_fprop": ("fprop_w", -2), "dy_dgrad": ("dgrad_dy", -1),
                  "w_dgrad": ("dgrad_w", -1), "x_wgrad": ("wgrad_x", -2), "dy_wgrad": ("wgrad_dy", -2)}


def check_dense(outs, ops, bias, dy, what: str = "dense", *, kernel: bool = False) -> dict:
    """(y, dx, dw, dbias) of `dense` (x2[M, K], w[K, N], bfloat16 or float32) against float64 products of the
    reproduced operands `ops`: y = fprop + bias (an fp32 addition, then the cast), dx = dgrad, dw = wgrad, each
    within gemm_bound over its contracted length (K, N, M) plus `cast_bound`; dbias within the fp32 summation bound
    of any order, gamma_(M-1) * sum |dy| (Higham eq. 4.4), plus the cast. kernel=True: the GEMMs ran on the
    `jf4_gemm` kernel (`kernel_gemm_bound`). Returns {name: (reference, bound)}."""
    y, dx, dw, db = outs
    dyf = f64(dy)
    checked = {}
    for name, got, (a, b, dn) in (("y", y, ("x_fprop", "w_fprop", FPROP)), ("dx", dx, ("dy_dgrad", "w_dgrad", DGRAD)),
                                  ("dw", dw, ("x_wgrad", "dy_wgrad", WGRAD))):
        qa, qb = ops[a], ops[b]
        k = qa.shape[dn[0][0][0]]
        ref, bound = operand_bound(qa, qb, dn, k, kernel=kernel)
        with_bias = name == "y" and bias is not None
        if with_bias:
            ref = ref + f64(bias)
        bound = cast_bound(ref, bound, got.dtype, added_in_f32=with_bias)
        assert_within(got, ref, bound, f"{what}: {name}")
        checked[name] = (ref, bound)
    if bias is not None:
        ref, absum = dyf.sum(0), np.abs(dyf).sum(0)
        bound = cast_bound(ref, (gamma(dyf.shape[0] - 1) + SLACK) * absum, db.dtype)
        assert_within(db, ref, bound, f"{what}: dbias")
        checked["dbias"] = (ref, bound)
    else:
        assert db is None
    return checked
