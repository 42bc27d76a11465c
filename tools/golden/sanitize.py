"""A workload for compute-sanitizer (memcheck, racecheck): every CUDA kernel family on small shapes with edge cases,
then the jf4_gemm variants on a Hopper GPU. `--gemm-only` runs just the jf4_gemm calls (racecheck of the whole
workload is slow)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4

N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((320, 192)), jnp.bfloat16)
xf = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
xl = jnp.asarray(rng.standard_normal((4064, 2016)), jnp.bfloat16)
k = jax.random.key(0)
GEMM_ONLY = "--gemm-only" in sys.argv
outs = [] if GEMM_ONLY else [
    jax_fp4.quantize_rowwise_columnwise(x, N(), N()),
    jax_fp4.quantize_rowwise_columnwise(x, M(), M(), scale_layout="swizzled", dbias=True),
    jax_fp4.quantize_rowwise_columnwise(x, N(), M(element="e5m2"), dbias=True),
    jax_fp4.quantize_rowwise_columnwise(x[:256], N(local_1x64=True), N(local_1x64=True)),
    jax_fp4.quantize_rowwise_columnwise(x, N(stochastic_rounding=True), N(stochastic_rounding=True), key=k),
    jax_fp4.quantize_rowwise_columnwise(x, N(scaling_2d=True), N(scaling_2d=True), scale_layout="swizzled"),
    jax_fp4.quantize(x, N(rht=True), axis=0),
    jax_fp4.quantize(x, N(rht=True), axis=-1),
    jax_fp4.quantize(xf, M(), axis=0),
    jax_fp4.quantize(xf.astype(jnp.float16)[:, :32], N(), axis=-1),
    jax_fp4.quantize(jnp.zeros((0, 64), jnp.bfloat16), N()),
    # exact GEMM operands (bf16 outputs) of the dense layer's passes, and the column-only strided path with K % 16
    jax_fp4.quantize_rowwise_columnwise(x, N(), M(), exact=(True, False)),
    jax_fp4.quantize_rowwise_columnwise(x, M(), M(), dbias=True, exact=(True, True)),
    jax_fp4.quantize_rowwise_columnwise(x, N(stochastic_rounding=True), N(rht=True), key=k, exact=(True, True)),
    jax_fp4.quantize_rowwise_columnwise(xf[:, :36], None, M(), exact=(False, True)),
    # MXFP8 kernels walking 4 tiles per block with the next tile's row segment prefetched (>= 2048 tiles), with a
    # partial last row tile and a partial last column tile (K % 64 = 32)
    jax_fp4.quantize_rowwise_columnwise(xl, M(), M(), dbias=True),
    jax_fp4.quantize_rowwise_columnwise(xl, M(), M(), exact=(True, True)),
    jax_fp4.quantize(xl, M(), axis=0),
    # grouped MXFP8 (4-tile work units, prefetched) with a group of 5 row tiles, an empty group and a tail
    jax_fp4.grouped_quantize_rowwise_columnwise(x[:, :128], jnp.asarray([288, 0, 32], jnp.int32), M(), M()),
    jax_fp4.grouped_quantize(x[:, :128], jnp.asarray([288, 0, 32], jnp.int32), M(element="e5m2")),
    # grouped NVFP4 with given amaxes: the columnwise ones read in place, the rowwise ones computed; then every amax
    # given (no amax kernel, no scratch memset)
    jax_fp4.grouped_quantize_rowwise_columnwise(x[:, :128], jnp.asarray([288, 0, 32], jnp.int32), N(), N(rht=True),
                                                col_amax=jnp.asarray([1.0, 2.0, 3.0], jnp.float32)),
    jax_fp4.grouped_quantize(x[:, :128], jnp.asarray([288, 0, 32], jnp.int32), N(),
                             amax=jnp.asarray([4.0, 5.0, 6.0], jnp.float32)),
    # 4over6 (1D and 2D, MAE and MSE, the 256 bound): single-tensor, exact and grouped (tile path) quantize
    jax_fp4.quantize_rowwise_columnwise(x, N(use_4over6=True), N(use_4over6=True, err_mode_4over6="MSE")),
    jax_fp4.quantize_rowwise_columnwise(x, N(use_4over6=True, scaling_2d=True), N(use_4over6=True, scaling_2d=True),
                                        scale_layout="swizzled"),
    jax_fp4.quantize_rowwise_columnwise(x, N(use_4over6=True), M(), exact=(True, False)),
    jax_fp4.grouped_quantize_rowwise_columnwise(x[:, :128], jnp.asarray([288, 0, 32], jnp.int32), N(use_4over6=True),
                                                N(use_4over6=True)),
]
q_nv = jax_fp4.quantize(x, N(rht=True), axis=0, scale_layout="swizzled")  # transposed output, swizzled scales
q_mx = jax_fp4.quantize(xf, M(), axis=0)  # columnwise, C = 40: partial segments
q_64 = jax_fp4.quantize(x[:256], N(local_1x64=True))
outs += [
    jax_fp4.dequantize(q_nv, jnp.bfloat16),
    jax_fp4.dequantize(q_mx, jnp.float16),
    jax_fp4.dequantize(q_64),
    jax_fp4.dequantize(jax_fp4.quantize(x[:, :36], N(), axis=0), jnp.bfloat16),  # R = 36: scalar stores
    jax.vmap(jax_fp4.dequantize)(jax.vmap(lambda y: jax_fp4.quantize(y, N(), axis=0))(x.reshape(2, 160, 192))),
    jax_fp4.dequantize(jax_fp4.quantize(jnp.zeros((0, 64), jnp.bfloat16), N())),
    # transposed NVFP4 over many tiles per persistent block (prefetched), partial last row and column tiles (4064 % 128,
    # 2016 % 64), plain / 1x64 / RHT; MXFP8 columnwise with swizzled scales through its shared-memory tiles (f32 out)
    jax_fp4.dequantize(jax_fp4.quantize(xl, N(), axis=0, scale_layout="swizzled")),
    jax_fp4.dequantize(jax_fp4.quantize(xl[:4032, :1984], N(local_1x64=True), axis=0), jnp.float32),
    jax_fp4.dequantize(jax_fp4.quantize(xl[:, :1024], N(rht=True), axis=0), jnp.float16),
    jax_fp4.dequantize(jax_fp4.quantize(xl, M(), axis=0, scale_layout="swizzled"), jnp.float32),
    # transposed NVFP4 whose 33 column tiles pad to 2 bands of 17 (a padding tile column), bf16 table decode
    jax_fp4.dequantize(jax_fp4.quantize(xl[:2112, :520], N(), axis=0)),
    # grouped NVFP4 columnwise through the single-tensor transposed tiles (an empty group, partial tiles), raw too
    jax_fp4.grouped_dequantize(jax_fp4.grouped_quantize(xl[:1184, :200], jnp.asarray([640, 0, 448, 96], jnp.int32), N(),
                                                        axis=0), jnp.bfloat16),
    jax_fp4.grouped_dequantize(jax_fp4.grouped_quantize(x, jnp.asarray([160, 64, 96], jnp.int32), N(), axis=0),
                               jnp.float32, raw=True),
    # ... and with the inverse RHT (its own transposed-tile instantiation): an empty group, partial tiles, f16
    jax_fp4.grouped_dequantize(jax_fp4.grouped_quantize(xl[:1184, :200], jnp.asarray([640, 0, 448, 96], jnp.int32),
                                                        N(rht=True), axis=0), jnp.float16),
    # 4over6 codes decode with the 256 bound: flat, transposed and grouped
    jax_fp4.dequantize(jax_fp4.quantize(x, N(use_4over6=True)), jnp.float32),
    jax_fp4.dequantize(jax_fp4.quantize(xl[:2112, :528], N(use_4over6=True, scaling_2d=True), axis=0)),
    jax_fp4.grouped_dequantize(jax_fp4.grouped_quantize(x, jnp.asarray([160, 64, 96], jnp.int32), N(use_4over6=True),
                                                        axis=0), jnp.bfloat16),
    jax_fp4.swizzle_scales(q_mx).scale,  # [40, 3] -> [128, 4]: padding rows and columns
    jax_fp4.unswizzle_scales(q_nv).scale,
    jax_fp4.unswizzle_scales(jax_fp4.swizzle_scales(jax_fp4.quantize(x, N()))).scale,
]


def _gemm(qa, qb, out_dtype, bias):
    """jf4_gemm called directly (Hopper only): out = qa . qb^T + bias with the output amax."""
    from jax_fp4._src.ffi_codes import GemmFlag, Kind

    ops = []
    for q in (qa, qb):
        aux = q.window_amax if q.fmt.local_1x64 else (q.amax if q.amax is not None else jnp.zeros((0,), jnp.float32))
        ops += [q.data, q.scale, aux]
    kinds = [int(Kind.NVFP4) if isinstance(q.fmt, N) else int(Kind.MXFP8_E5M2 if q.fmt.element == "e5m2"
                                                               else Kind.MXFP8_E4M3) for q in (qa, qb)]
    flags = GemmFlag.EMIT_AMAX | (GemmFlag.A_LOCAL_1X64 | GemmFlag.B_LOCAL_1X64 if qa.fmt.local_1x64 else 0)
    shapes = (jax.ShapeDtypeStruct((qa.shape[0], qb.shape[0]), out_dtype), jax.ShapeDtypeStruct((), jnp.float32))
    return jax.ffi.ffi_call("jf4_gemm", shapes)(*ops, bias, a_kind=np.int32(kinds[0]), b_kind=np.int32(kinds[1]),
                                                flags=np.int32(int(flags)))


if str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
    # edge tiles in M and N (200 % 128, 136 % 128), a partial K-tile (K = 160), several K-tiles, bias, both outputs,
    # mixed formats, and 1x64 windows
    xa, xb = x[:200, :160], x[64:200, :160]
    nobias = jnp.zeros((0,), jnp.float32)
    outs += [
        _gemm(jax_fp4.quantize(xa, N()), jax_fp4.quantize(xb, N()), jnp.bfloat16, jnp.ones((136,), jnp.float32)),
        _gemm(jax_fp4.quantize(xa, M()), jax_fp4.quantize(xb, M(element="e5m2")), jnp.float32, nobias),
        _gemm(jax_fp4.quantize(xa, N()), jax_fp4.quantize(xb, M()), jnp.bfloat16, nobias),
        # NVFP4 with K % 32 == 16: 8-byte rows, the two-copy path
        _gemm(jax_fp4.quantize(x[:200, :144], N()), jax_fp4.quantize(x[64:200, :144], N()), jnp.float32, nobias),
        _gemm(jax_fp4.quantize(xa, M(element="e5m2")), jax_fp4.quantize(xb, N()), jnp.float32, nobias),
        _gemm(jax_fp4.quantize(x[:256], N(local_1x64=True)), jax_fp4.quantize(x[64:256], N(local_1x64=True)),
              jnp.float32, nobias),
    ]
jax.block_until_ready(outs)
print("sanitize workload done")
