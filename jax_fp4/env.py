"""The environment report of `python -m jax_fp4`: versions, the compiled kernels, the device and each recipe's GEMMs.

`env_report()` returns it as a dict, `format_env_report()` as the text `python -m jax_fp4` prints. The GEMM routes
come from `jax_fp4.gemm.gemm_route`, made of the checks `scaled_dot_general` decides with.
"""

from __future__ import annotations

import importlib.metadata
import platform

import jax

from jax_fp4 import gemm
from jax_fp4._src import ffi
from jax_fp4._version import __version__
from jax_fp4.recipes import RECIPES

__all__ = ["env_report", "format_env_report", "PLUGIN_PACKAGES"]

#: Distributions whose versions the report lists when installed (jax's CUDA plugins, both CUDA majors).
PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_extension() -> dict:
    ext = ffi.extension()
    if ext is None:
        return {"built": False, "architectures": [], "cuda_compiler": None, "error": str(ffi.import_error())}
    # Extensions built before the attributes existed expose neither: reported as unknown (None / []).
    return {"built": True, "architectures": list(getattr(ext, "cuda_architectures", ())),
            "cuda_compiler": getattr(ext, "cuda_compiler_version", None) or None, "error": None}


def _device() -> dict:
    devices = jax.devices()
    dev = devices[0]
    cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
    return {"platform": dev.platform, "kind": dev.device_kind, "count": len(devices),
            "compute_capability": None if cc is None else str(cc)}


def _kernels_here(platform_name: str, cuda: bool, cpu: bool) -> str:
    if platform_name == "gpu" and cuda:
        return "CUDA kernels"
    if platform_name == "cpu" and cpu:
        return "CPU kernels"
    return "reference"


def env_report() -> dict:
    """The environment as a dict (JSON-serializable: str, bool, int, None, lists and dicts).

    Keys: "jax_fp4" (version), "python", "platform", "packages" ({distribution: version or None}: jax, jaxlib and
    `PLUGIN_PACKAGES`), "cuda_extension" ({"built", "architectures": e.g. ["sm_90a", "sm_100a", "compute_90"],
    "cuda_compiler": nvcc version, "error": why it did not import}), "cpu_kernels" ({"built"}), "device"
    ({"platform", "kind", "count", "compute_capability": "9.0" on a GPU, else None}), "kernels" (what quantize /
    dequantize run on the default device: "CUDA kernels", "CPU kernels" or "reference"), "native_gemm" ({"auto":
    compute capability >= 10, "on_request": jax.nn.scaled_matmul lowers here}), "kernel_gemm" ({"on_request": the
    jf4_gemm kernel runs here (compute capability 9.x and the CUDA extension with it), "auto": the pairs
    implementation="auto" puts on it, or False}), "recipes" ({recipe name: {"fprop", "dgrad", "wgrad": "kernel",
    "native", "emulated" or "bf16"}}, the route implementation="auto" takes for each GEMM).
    """
    cuda = _cuda_extension()
    cpu_built = bool(getattr(ffi, "HAS_CPU_KERNELS", False))
    dev = _device()
    routes = {}
    for name, make in RECIPES.items():
        r = make()
        routes[name] = {"fprop": gemm.gemm_route(r.fprop_x, r.fprop_w), "dgrad": gemm.gemm_route(r.dgrad_dy, r.dgrad_w),
                        "wgrad": gemm.gemm_route(r.wgrad_x, r.wgrad_dy)}
    return {
        "jax_fp4": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "packages": {d: _version(d) for d in ("jax", "jaxlib", *PLUGIN_PACKAGES)},
        "cuda_extension": cuda,
        "cpu_kernels": {"built": cpu_built},
        "device": dev,
        "kernels": _kernels_here(dev["platform"], cuda["built"], cpu_built),
        "native_gemm": {"auto": gemm.native_gemm_available(), "on_request": gemm.scaled_matmul_lowers()},
        "kernel_gemm": {"on_request": gemm.kernel_gemm_available(),
                        "auto": gemm.kernel_gemm_available() and ("every pair" if gemm.AUTO_TAKES_KERNEL else
                                                                  "NVFP4 1x64 pairs")},
        "recipes": routes,
    }


def format_env_report(report: dict | None = None) -> str:
    """`env_report()` (or the given report) as the lines `python -m jax_fp4` prints."""
    r = env_report() if report is None else report
    pk = r["packages"]
    plugins = ", ".join(f"{d} {v}" for d, v in pk.items() if d in PLUGIN_PACKAGES and v) or "none"
    cuda = r["cuda_extension"]
    if cuda["built"]:
        archs = ", ".join(cuda["architectures"]) or "unknown architectures"
        cuda_line = f"built for {archs}" + (f" (nvcc {cuda['cuda_compiler']})" if cuda["cuda_compiler"] else "")
    else:
        cuda_line = f"not built ({cuda['error']})"
    dev = r["device"]
    dev_line = f"{dev['platform']} {dev['kind']} x{dev['count']}"
    if dev["compute_capability"] is not None:
        dev_line += f", compute capability {dev['compute_capability']}"
    ng = r["native_gemm"]
    kg = r.get("kernel_gemm", {})
    lines = [
        f"jax_fp4 {r['jax_fp4']} (Python {r['python']}, {r['platform']})",
        f"jax {pk['jax']}, jaxlib {pk['jaxlib']}; plugins: {plugins}",
        f"CUDA extension: {cuda_line}",
        f"CPU kernels: {'built' if r['cpu_kernels']['built'] else 'not built'}",
        f"device: {dev_line}",
        f"quantize / dequantize here: {r['kernels']}",
        f"native GEMM (jax.nn.scaled_matmul): auto {'yes' if ng['auto'] else 'no (needs compute capability >= 10)'}; "
        f"on request: {'yes' if ng['on_request'] else 'no (does not lower here)'}",
        f"jf4_gemm kernel: on request {'yes' if kg.get('on_request') else 'no (needs compute capability 9.x)'}; "
        f"auto: {kg.get('auto') or 'no'}",
        "GEMM route per recipe (implementation='auto'):",
        f"  {'recipe':<22}{'fprop':<10}{'dgrad':<10}{'wgrad'}",
    ]
    for name, g in r["recipes"].items():
        lines.append(f"  {name:<22}{g['fprop']:<10}{g['dgrad']:<10}{g['wgrad']}")
    return "\n".join(lines)
