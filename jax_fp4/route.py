"""Which route a block-scaled GEMM takes: the one decision `scaled_dot_general`, `dense` and `python -m jax_fp4` ask.

Routes:
  * "kernel": the `jf4_gemm` primitive (CUDA sm_90a; jax_fp4/_src/primitives/gemm.py), on compute capability 9.x
    when the CUDA extension provides it, for the pairs `kernel_formats_ok` takes: not 1x64 x non-1x64, and no
    4over6 operand (the kernel's tensor scale is amax / 2688 only).
  * "native": `jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM on compute capability >= 10; XLA's dequantize + dot
    where it lowers elsewhere), for MXFP8 x MXFP8 and NVFP4 1D x NVFP4 1D.
  * "emulated": exact block-scaled operands multiplied by `lax.dot_general` with float32 accumulation (every device).
  * "bf16": an operand is unquantized (format None): plain `lax.dot_general`.

`gemm_route(fa, fb, implementation, device)` is a pure function of its arguments; `device` defaults to
`GemmDevice.default()`, the probe of the default JAX device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax_fp4._src.primitives import gemm as _gemm_prim
from jax_fp4.formats import Format

__all__ = ["IMPLEMENTATIONS", "ROUTES", "GemmDevice", "gemm_route", "recipe_routes", "auto_takes_kernel",
           "kernel_formats_ok", "native_formats_ok", "kernel_gemm_available", "native_gemm_available",
           "scaled_matmul_lowers"]

#: What a caller may ask for: "auto" (this module's choice), or one route by name.
IMPLEMENTATIONS = ("auto", "emulated", "kernel", "native")
#: What `gemm_route` answers.
ROUTES = ("bf16", "emulated", "kernel", "native")


def _compute_capability(dev) -> float:
    try:
        return float(getattr(dev, "compute_capability", "0"))
    except ValueError:
        return 0.0


def native_gemm_available() -> bool:
    """True when the default device is a GPU of compute capability >= 10 (block-scaled tensor cores)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and _compute_capability(dev) >= 10.0


def kernel_gemm_available() -> bool:
    """True when the default device is a GPU of compute capability 9.x (Hopper) and the CUDA extension provides the
    `jf4_gemm` kernel (sm_90a WGMMA)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu" or not _gemm_prim.cuda_kernel_registered():
        return False
    return 9.0 <= _compute_capability(dev) < 10.0


@functools.cache
def _lowers(fn, backend: str) -> bool:
    spec = jax.ShapeDtypeStruct((1, 1, 32), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((1, 1, 1), jnp.float8_e8m0fnu)
    try:
        jax.jit(fn).lower(spec, spec, scale, scale)  # on the default backend; `backend` keys the cache
    except NotImplementedError:  # "MLIR translation rule for primitive 'scaled_matmul' not found for platform ..."
        return False
    return True


def scaled_matmul_lowers() -> bool:
    """True when `jax.nn.scaled_matmul` lowers on the default backend (then implementation="native" may be asked).

    Probed once per backend by lowering a 1x1x32 MXFP8 product (no compilation): CUDA always (cuDNN on compute
    capability >= 10, XLA's dequantize + dot elsewhere), the CPU from jax 0.11 on.
    """
    return _lowers(jax.nn.scaled_matmul, jax.default_backend())


@dataclass(frozen=True)
class GemmDevice:
    """What the route depends on about a device.

    Attributes:
      kernel: `jf4_gemm` runs there (`kernel_gemm_available`).
      block_scaled_tensor_cores: compute capability >= 10 (`native_gemm_available`): "auto" takes the native route.
      scaled_matmul_lowers: `jax.nn.scaled_matmul` lowers there (implementation="native" may be asked); None: not
        probed yet (`gemm_route` probes it when "native" is asked).
      name: the device, for error messages.
    """

    kernel: bool = False
    block_scaled_tensor_cores: bool = False
    scaled_matmul_lowers: bool | None = False
    name: str = "a device without a block-scaled GEMM"

    @classmethod
    def default(cls, probe_scaled_matmul: bool = False) -> GemmDevice:
        """The default JAX device, probed (`scaled_matmul_lowers` only with probe_scaled_matmul: it lowers a
        product)."""
        lowers = scaled_matmul_lowers() if probe_scaled_matmul else None
        return cls(kernel=kernel_gemm_available(), block_scaled_tensor_cores=native_gemm_available(),
                   scaled_matmul_lowers=lowers, name=str(jax.devices()[0]))


def kernel_formats_ok(fa, fb) -> bool:
    """Whether `jf4_gemm` takes a pair of operand formats (NVFP4 1D/2D/RHT, MXFP8 E4M3/E5M2 in any pairing; NVFP4
    1x64 only with 1x64)."""
    return _gemm_prim.kernel_formats_ok(fa, fb)


def native_formats_ok(fa, fb) -> bool:
    """Whether the native route takes a pair of formats: MXFP8 x MXFP8 (E4M3/E5M2) or NVFP4 1D x NVFP4 1D (no 2D
    scaling, RHT or 1x64 windows: cuDNN's block-scaled GEMM has one 1x16 E4M3 or 1x32 E8M0 scale per block)."""
    if not (isinstance(fa, Format) and isinstance(fb, Format)) or type(fa) is not type(fb):
        return False
    return not any(f.local_1x64 or f.rht or f.scaling_2d for f in (fa, fb))


def auto_takes_kernel(fa, fb) -> bool:
    """Whether implementation="auto" puts a product of formats fa x fb on `jf4_gemm` where the kernel runs.

    NVFP4 1x64 pairs only: the kernel runs them faster than the emulated route's float32 GEMM of the dequantized
    operands, while for MXFP8 and NVFP4 1D pairs it is slower than the emulated route's cuBLAS bf16 GEMM
    (benchmarks/gemm.py; the measured table: docs/performance.md, "Block-scaled GEMM").
    """
    return bool(fa.local_1x64 and fb.local_1x64)


def gemm_route(fa, fb, implementation: str = "auto", device: GemmDevice | None = None, *, kernel_fits: bool = True,
               native_fits: bool = True, caller: str = "gemm_route") -> str:
    """The route of one GEMM of operands in formats fa and fb on `device`: one of `ROUTES`.

    Args:
      fa, fb: `jax_fp4.Format` instances, or None for an unquantized operand (then "bf16").
      implementation: "auto" (the kernel for the pairs `auto_takes_kernel` names where it runs, else native on
        compute capability >= 10 where the formats allow, else emulated), "emulated", "kernel" (the kernel wherever
        the formats and operands allow, else emulated) or "native" (likewise for `jax.nn.scaled_matmul`).
      device: a `GemmDevice`; default `GemmDevice.default()`.
      kernel_fits, native_fits: whether the operands' shapes suit the kernel / the native GEMM (`scaled_dot_general`
        says; a 2-D product contracted along both block axes, as every GEMM of `dense`, fits both).
      caller: the name error messages begin with.

    Raises:
      ValueError: an unknown implementation; "kernel" on a device where `jf4_gemm` does not run; "native" where
      `jax.nn.scaled_matmul` does not lower.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{caller}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if fa is None or fb is None:
        return "bf16"
    if implementation == "emulated":
        return "emulated"
    device = GemmDevice.default() if device is None else device
    kernel = kernel_fits and kernel_formats_ok(fa, fb)
    native = native_fits and native_formats_ok(fa, fb)
    if implementation == "kernel":
        if not device.kernel:
            raise ValueError(f"{caller}: implementation='kernel' needs the jf4_gemm kernel: no jf4_gemm kernel on "
                             f"{device.name} (it needs a GPU of compute capability 9.x and the CUDA extension built "
                             f"with jf4_gemm; CUDA extension: {_gemm_prim.cuda_kernel_registered()})")
        return "kernel" if kernel else "emulated"
    if implementation == "native":
        lowers = device.scaled_matmul_lowers
        if not (scaled_matmul_lowers() if lowers is None else lowers):
            raise ValueError(f"{caller}: no native block-scaled GEMM on {device.name}: jax.nn.scaled_matmul does not "
                             f"lower on {jax.default_backend()} (jax {jax.__version__})")
        return "native" if native else "emulated"
    if kernel and device.kernel and auto_takes_kernel(fa, fb):
        return "kernel"
    return "native" if native and device.block_scaled_tensor_cores else "emulated"


def recipe_routes(recipe, implementation: str = "auto", device: GemmDevice | None = None) -> dict:
    """{"fprop", "dgrad", "wgrad": route} of `jax_fp4.dense`'s three GEMMs under `recipe` (a `jax_fp4.recipes.Recipe`),
    each `gemm_route` of its pair of formats (2-D products contracted along their block axes)."""
    device = GemmDevice.default() if device is None and implementation != "emulated" else device
    pairs = {"fprop": (recipe.fprop_x, recipe.fprop_w), "dgrad": (recipe.dgrad_dy, recipe.dgrad_w),
             "wgrad": (recipe.wgrad_x, recipe.wgrad_dy)}
    return {g: gemm_route(fa, fb, implementation, device, caller="dense") for g, (fa, fb) in pairs.items()}
