"""The environment report of `python -m jax_fp4`: versions, the compiled kernels, the device and each recipe's GEMMs.

`env_report()` returns it as a dict, `format_env_report()` as the text `python -m jax_fp4` prints. The GEMM routes
come from `jax_fp4.route`, the decision `scaled_dot_general` and `dense` take.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import jax

from jax_fp4 import route
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
        st = ffi.load_state("cuda")
        state = "failed" if st["state"] == "failed" else "absent"
        return {"built": False, "state": state, "architectures": [], "cuda_compiler": None,
                "error": st["error"] or str(ffi.import_error()), "fix": st["fix"], "file": st["file"]}
    # Extensions built before the attributes existed expose neither: reported as unknown (None / []).
    return {"built": True, "state": "loaded", "architectures": list(getattr(ext, "cuda_architectures", ())),
            "cuda_compiler": getattr(ext, "cuda_compiler_version", None) or None, "error": None, "fix": None,
            "file": getattr(ext, "__file__", None)}


def _package() -> dict:
    import jax_fp4

    return {"path": os.path.dirname(os.path.abspath(jax_fp4.__file__)), "source_tree": ffi.source_tree(),
            "installed_version": _version("jax_fp4")}


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

    Keys: "jax_fp4" (version), "python", "platform", "package" ({"path": the imported package's directory,
    "source_tree": True when that is a source checkout without compiled extensions (`ffi.source_tree`),
    "installed_version": the installed distribution's version or None}), "packages" ({distribution: version or
    None}: jax, jaxlib and `PLUGIN_PACKAGES`), "cuda_extension" ({"built", "state": "loaded" | "absent" | "failed",
    "architectures": e.g. ["sm_90a", "sm_100a", "compute_90"], "cuda_compiler": nvcc version, "error": why it did
    not import, "fix": the remedy of a file that failed to load, "file"}), "cpu_kernels" ({"built", "state",
    "error", "fix"}), "device"
    ({"platform", "kind", "count", "compute_capability": "9.0" on a GPU, else None}), "kernels" (what quantize /
    dequantize run on the default device: "CUDA kernels", "CPU kernels" or "reference"), "native_gemm" ({"auto":
    compute capability >= 10, "on_request": jax.nn.scaled_matmul lowers here}), "kernel_gemm" ({"on_request": the
    jf4_gemm kernel runs here (compute capability 9.x and the CUDA extension with it), "auto": the pairs
    implementation="auto" puts on it, or False}), "recipes" ({recipe name: {"fprop", "dgrad", "wgrad": "kernel",
    "native", "emulated" or "bf16"}}, the route implementation="auto" takes for each GEMM).
    """
    cuda = _cuda_extension()
    cpu_built = bool(getattr(ffi, "HAS_CPU_KERNELS", False))
    cpu_state = ffi.load_state("cpu")
    dev = _device()
    gemm_device = route.GemmDevice.default(probe_scaled_matmul=True)
    routes = {name: route.recipe_routes(make(), device=gemm_device) for name, make in RECIPES.items()}
    return {
        "jax_fp4": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "package": _package(),
        "packages": {d: _version(d) for d in ("jax", "jaxlib", *PLUGIN_PACKAGES)},
        "cuda_extension": cuda,
        "cpu_kernels": {"built": cpu_built, "state": "loaded" if cpu_built else cpu_state["state"],
                        "error": None if cpu_built else cpu_state["error"], "fix": cpu_state["fix"]},
        "device": dev,
        "kernels": _kernels_here(dev["platform"], cuda["built"], cpu_built),
        "native_gemm": {"auto": gemm_device.block_scaled_tensor_cores, "on_request": gemm_device.scaled_matmul_lowers},
        "kernel_gemm": {"on_request": gemm_device.kernel, "auto": gemm_device.kernel and "NVFP4 1x64 pairs"},
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
    elif cuda.get("state") == "failed":
        cuda_line = f"FAILED TO LOAD {cuda.get('file') or ''} ({cuda['error']}); fix: {cuda['fix']}"
    else:
        cuda_line = ("not built (no nvcc at build time, or JAX_FP4_CUDA=OFF: GPUs run the reference; "
                     "JAX_FP4_CUDA=ON pip install . with nvcc on PATH builds it)")
    cpu = r["cpu_kernels"]
    if cpu["built"]:
        cpu_line = "built"
    elif cpu.get("state") == "failed":
        cpu_line = f"FAILED TO LOAD ({cpu['error']}); fix: {cpu['fix']}"
    else:
        cpu_line = "not built (the CPU runs the reference)"
    pkg = r.get("package")
    pkg_lines = []
    if pkg is not None:
        if pkg["source_tree"]:
            inst = (f"an installed jax_fp4 {pkg['installed_version']} exists" if pkg["installed_version"] else
                    "no installed jax_fp4 was found (pip install \".[examples,test]\")")
            pkg_lines = [f"package: {pkg['path']} -- a SOURCE TREE without compiled extensions: this report "
                         f"describes the checkout, not the installed package; {inst}. Run python -P -m jax_fp4 "
                         "(-P keeps the current directory off sys.path) or run it from another directory"]
        else:
            pkg_lines = [f"package: {pkg['path']}"]
    dev = r["device"]
    dev_line = f"{dev['platform']} {dev['kind']} x{dev['count']}"
    if dev["compute_capability"] is not None:
        dev_line += f", compute capability {dev['compute_capability']}"
    ng = r["native_gemm"]
    kg = r.get("kernel_gemm", {})
    lines = [
        f"jax_fp4 {r['jax_fp4']} (Python {r['python']}, {r['platform']})",
        *pkg_lines,
        f"jax {pk['jax']}, jaxlib {pk['jaxlib']}; plugins: {plugins}",
        f"CUDA extension: {cuda_line}",
        f"CPU kernels: {cpu_line}",
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
