import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4.reference import codes

N, M = jax_fp4.NVFP4, jax_fp4.MXFP8
EDGE = np.array([0.0, -0.0, 1e-40, -3e-39, 1.17e-38, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0, 57344.0,
                 np.inf, -np.inf, np.nan, 3.0e38, -1e-45], np.float32)
DT = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}


def make_x(shape, dt, seed, exp=0):
    """N(0, 2**exp) with the EDGE values at 40 random positions; exp="max": N(0, 1) with +-the dtype's largest
    finite value at 1/8 of the positions and +-inf at two (MXFP8 codes that round up past the range)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0**(0 if exp == "max" else exp)).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size and exp == "max":
        big = float(jnp.finfo(DT[dt]).max)
        pos = rng.choice(flat.size, flat.size // 8 + 2, replace=False)
        flat[pos] = np.where(np.arange(pos.size) % 2, big, -big)
        flat[pos[:2]] = [np.inf, -np.inf]
    elif flat.size:
        pos = rng.choice(flat.size, min(40, flat.size), replace=False)
        flat[pos] = np.resize(EDGE, pos.size)
    return jnp.asarray(x, DT[dt])


def cases():
    out = []
    fmts = [N(), N(scaling_2d=True), N(rht=True), N(stochastic_rounding=True), N(local_1x64=True), M(),
            M(element="e5m2")]
    for fmt in fmts:
        for axis in (-1, 0):
            for lay in ("compact", "swizzled"):
                out.append(("q", "bf16", (256, 192), 0, fmt, axis, lay))
    for fmt in (N(), N(rht=True), M(), M(element="e5m2")):
        for axis in (-1, 0):
            out.append(("q", "bf16", (320, 64), 100, fmt, axis, "swizzled"))
            out.append(("q", "f32", (128, 128), -120, fmt, axis, "compact"))
            out.append(("q", "f16", (64, 64), 0, fmt, axis, "compact"))
    out.append(("q", "bf16", (64, 48), 0, N(), -1, "compact"))
    out.append(("q", "bf16", (64, 48), 0, M(), 0, "compact"))
    out.append(("q", "bf16", (64, 48), 0, N(), 0, "compact"))
    for fmt in (N(), N(scaling_2d=True), N(rht=True), M(), N(local_1x64=True)):
        out.append(("q", "bf16", (3, 64, 128), 0, fmt, 1, "compact"))
    for fmt in (N(use_4over6=True), N(use_4over6=True, scaling_2d=True), N(use_4over6=True, err_mode_4over6="MSE")):
        for axis in (-1, 0):
            out.append(("q", "bf16", (256, 192), 0, fmt, axis, "swizzled" if axis else "compact"))
            out.append(("q", "f32", (128, 128), -120, fmt, axis, "compact"))
    out.append(("q", "bf16", (0, 64), 0, N(), -1, "compact"))
    out.append(("q", "bf16", (64, 0), 0, M(), 0, "swizzled"))
    pairs = [(N(), N()), (M(), M()), (N(), M()), (N(), M(element="e5m2")), (N(scaling_2d=True), N(scaling_2d=True)),
             (N(), N(rht=True)), (N(stochastic_rounding=True), N(stochastic_rounding=True)),
             (N(local_1x64=True), N(local_1x64=True)), (M(), M(element="e5m2")), (None, M()), (M(), None)]
    for r, c in pairs:
        out.append(("rc", "bf16", (256, 192), 0, (r, c), None, "compact"))
    for r, c in pairs[:4]:
        out.append(("rc", "bf16", (320, 64), 0, (r, c), None, "swizzled"))
        out.append(("rc", "f32", (4, 32, 64), 0, (r, c), None, "compact"))
    for fmt in fmts[:3] + fmts[4:]:  # dequantize (jf4_dequantize): every format except SR (same decode as 1D)
        for axis in (-1, 0):
            for lay in ("compact", "swizzled"):
                out.append(("dq", "bf16", (320, 128), 0, (fmt, "f32" if lay == "compact" else "bf16"), axis, lay))
        out.append(("dq", "f32", (2, 64, 128), -120, (fmt, "f16"), 1, "compact"))
    out.append(("vmap", "bf16", (3, 64, 96), 0, N(), -1, "compact"))
    out.append(("vmap", "bf16", (3, 64, 96), 0, M(), 0, "compact"))
    # >= 256 tiles: a thread block walks 2 tiles down the rows (27 row tiles: the last block has one).
    out.append(("rc", "bf16", (1024, 1024), 0, (N(), N()), None, "compact"))
    out.append(("rc", "bf16", (1728, 1024), 0, (N(), M()), None, "swizzled"))
    out.append(("q", "bf16", (1728, 1024), 0, N(scaling_2d=True), -1, "compact"))
    out.append(("q", "bf16", (1728, 1024), 0, M(), 0, "compact"))
    # dequantize paths added with the public switch: MXFP8 columnwise with C % 16 != 0 (partial segments), NVFP4
    # transposed output with R % 8 != 0 (scalar stores), vmap (one amax per p; swizzled: jf4_unswizzle first).
    out.append(("dq", "bf16", (64, 40), 0, (M(), "f16"), 0, "compact"))
    out.append(("dq", "bf16", (64, 36), 0, (N(), "bf16"), 0, "swizzled"))
    out.append(("vdq", "bf16", (3, 64, 96), 0, N(rht=True), 0, "swizzled"))
    out.append(("vdq", "bf16", (3, 64, 96), 0, M(), 0, "compact"))
    # jf4_swizzle / jf4_unswizzle (fmt: the scale dtype): padding rows and columns, batches, > 1 stripe, empty.
    for shape, dt in (((130, 5), "e4m3"), ((2, 320, 70), "e8m0"), ((256, 132), "u8"), ((2048, 260), "e4m3"),
                      ((3, 2), "e8m0"), ((0, 4), "u8"), ((5, 0), "u8")):
        out.append(("sw", "f32", shape, 0, dt, None, "swizzled"))
    out.append(("swq", "bf16", (320, 192), 0, N(), 0, "compact"))  # public swizzle_scales
    out.append(("swq", "bf16", (320, 192), 0, M(), 0, "swizzled"))  # public unswizzle_scales
    # MXFP8 decode saturation (docs/numerics.md section 2): +-max of each input dtype decoded to every output dtype,
    # both orientations and layouts (the rows, flat, columnwise and swizzled-columnwise kernels), and the exact
    # bf16 operands of the quantize pass.
    for fmt in (M(), M(element="e5m2")):
        for dt, out_dt in (("bf16", "bf16"), ("f16", "f16"), ("f32", "f32"), ("f32", "bf16"), ("bf16", "f16")):
            for axis, lay in ((-1, "compact"), (0, "compact"), (0, "swizzled")):
                out.append(("dq", dt, (128, 64), "max", (fmt, out_dt), axis, lay))
        out.append(("dq", "bf16", (64, 40), "max", (fmt, "bf16"), 0, "compact"))  # partial segments
        for dt in ("bf16", "f32"):
            out.append(("rcx", dt, (128, 128), "max", (fmt, fmt), None, "compact"))
    out.append(("rcx", "bf16", (128, 128), "max", (N(), M()), None, "swizzled"))
    return out


SCALE_DT = {"e4m3": jnp.float8_e4m3fn, "e8m0": jnp.float8_e8m0fnu, "u8": jnp.uint8}


def _scale_bytes(x, dt):
    """Deterministic scale codes of dtype `dt` from x's fp32 mantissa bits (same shape as x)."""
    b = (jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) >> 13).astype(jnp.uint8)
    return b if dt == "u8" else jax.lax.bitcast_convert_type(b, SCALE_DT[dt])


def _swizzle_case(x, dt):
    """swizzle(s), unswizzle(swizzle(s)) and unswizzle of a swizzled matrix with nonzero padding bytes."""
    from jax_fp4._src.primitives.swizzle import swizzle, unswizzle

    s = _scale_bytes(x, dt)
    rows, cols = s.shape[-2:]
    sw = swizzle(s)
    noisy = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(sw, jnp.uint8) ^ jnp.uint8(0xA5), sw.dtype)
    return sw, unswizzle(sw, rows, cols), unswizzle(noisy, rows, cols)


def fn(case):
    kind, dt, shape, exp, fmt, axis, lay = case
    if kind == "q":
        return lambda x, k: jax_fp4.quantize(x, fmt, axis=axis, key=k, scale_layout=lay)
    if kind == "rc":
        return lambda x, k: jax_fp4.quantize_rowwise_columnwise(x, fmt[0], fmt[1], key=k, scale_layout=lay)[:2]
    if kind == "rcx":
        return lambda x, k: jax_fp4.quantize_rowwise_columnwise(x, fmt[0], fmt[1], key=k, scale_layout=lay,
                                                                exact=(True, True))[:2]
    if kind == "dq":
        from jax_fp4._src.primitives.dequantize import dequantize_array

        f, out = fmt
        return lambda x, k: dequantize_array(jax_fp4.quantize(x, f, axis=axis, key=k, scale_layout=lay), DT[out])
    if kind == "vdq":
        return lambda x, k: jax.vmap(lambda y: jax_fp4.dequantize(
            jax_fp4.quantize(y, fmt, axis=axis, scale_layout=lay), jnp.bfloat16))(x)
    if kind == "sw":
        return lambda x, k: _swizzle_case(x, fmt)
    if kind == "swq":
        if lay == "compact":
            return lambda x, k: jax_fp4.swizzle_scales(jax_fp4.quantize(x, fmt, axis=axis)).scale
        return lambda x, k: jax_fp4.unswizzle_scales(jax_fp4.quantize(x, fmt, axis=axis, scale_layout=lay)).scale
    return lambda x, k: jax.vmap(lambda y: jax_fp4.quantize(y, fmt, axis=axis))(x)


#: Custom calls each kind must lower to on the GPU (check.py reports "OK-but-no-kernel" otherwise).
KERNELS = {"q": ("jf4_quantize",), "rc": ("jf4_quantize",), "rcx": ("jf4_quantize",), "vmap": ("jf4_quantize",),
           "dq": ("jf4_quantize", "jf4_dequantize"), "vdq": ("jf4_dequantize",),
           "sw": ("jf4_swizzle", "jf4_unswizzle"), "swq": ("jf4_quantize",)}


def expected_kernels(case):
    kind, shape, lay = case[0], case[2], case[6]
    if 0 in shape:  # empty: nothing to launch
        return ()
    if kind == "swq":
        return KERNELS[kind] + (("jf4_swizzle",) if lay == "compact" else ("jf4_unswizzle",))
    if kind == "vdq" and lay == "swizzled":
        return KERNELS[kind] + ("jf4_unswizzle",)
    return KERNELS[kind]


def bits(a):
    a = jnp.asarray(a)
    if a.dtype.itemsize == 1 or a.dtype.name.startswith("float4"):
        return np.asarray(codes.from_dtype(a)).astype(np.uint8).reshape(-1)
    return np.asarray(a).reshape(-1).view(np.uint8)


def leaves(out):
    return [bits(a) for a in jax.tree.leaves(out)]
