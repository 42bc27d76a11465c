"""Loading and registering the extensions `jax_fp4._jax_fp4_cuda` and `jax_fp4._jax_fp4_cpu`.

Importing this module tries to import both. When the CUDA extension is present, every FFI handler it exports
(`registrations()`: target name -> PyCapsule) is registered with `jax.ffi.register_ffi_target(..., platform="CUDA")`
exactly once, and the primitives add their CUDA lowerings. When it is absent (the wheel was built without a CUDA
compiler, or with JAX_FP4_CUDA=OFF) the primitives lower to the pure-JAX reference on GPUs: results are the same
bits, only slower.

The CPU extension (cpp/cpu/, built by the host C++ compiler with every wheel) holds host handlers for some targets
under the same names; they are registered for platform "cpu" (`ensure_cpu_registered`, `cpu_targets`) and the
primitives lower to them on the CPU. Without it (a source checkout imported directly) the CPU runs the reference.

Each extension is in one of three states (`load_state`): "loaded"; "absent" (no file: a CPU-only build, or a source
checkout imported without building); "failed" (a file exists but does not load, e.g. it needs a newer glibc than the
system's: the error and its fix are in `load_state(...)["error"]` / `["fix"]` and the report of `python -m jax_fp4`).
Importing warns (`ReferenceOnlyWarning`, once) only where something the user can fix is missing (`startup_warning`):
an extension that failed to load; a source checkout without the compiled extensions (run `python -P`, so the installed
package is imported); no CUDA extension while a jax CUDA plugin is installed (GPUs would run the reference). A
CPU-only install (CPU kernels loaded, no jax CUDA plugin) imports silently.

This module imports only jax and the extension (no other jax_fp4 module), so any layer may import it.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.metadata
import os
import threading
import warnings
from types import ModuleType

import jax

__all__ = ["HAS_CPU_KERNELS", "HAS_CUDA_KERNELS", "ReferenceOnlyWarning", "cpu_import_error", "cpu_rule", "cpu_targets",
           "ensure_cpu_registered", "ensure_registered", "extension", "import_error", "load_fix", "load_state",
           "reference_lowering_on_cpu", "source_tree", "startup_warning", "targets", "CUDA_PLUGINS"]


class ReferenceOnlyWarning(UserWarning):
    """A compiled extension jax_fp4 could use is missing or failed to load; the ops it serves run the pure-JAX
    reference (same bits, slower). The message says which, why and the fix."""


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jax_fp4
#: jax's CUDA plugin distributions: one of them installed means JAX may run on an NVIDIA GPU here.
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def _files(short: str) -> list[str]:
    """The extension files of `short` ("_jax_fp4_cuda") in the package directory (none in a CPU-only build or an
    unbuilt checkout; an editable install keeps them in its build directory, found by its import hook)."""
    return sorted(glob.glob(os.path.join(_PKG_DIR, short + "*.so")) +
                  glob.glob(os.path.join(_PKG_DIR, short + "*.pyd")))


def _load(name: str = "jax_fp4._jax_fp4_cuda") -> tuple[ModuleType | None, BaseException | None]:
    try:
        return importlib.import_module(name), None
    except ImportError as e:  # not built, or built for another Python / platform / glibc
        return None, e
    except OSError as e:  # a dependent library that cannot be opened
        return None, e


def _absent(error: BaseException | None, name: str) -> bool:
    """Whether the import failed because no such module exists (rather than a file that does not load)."""
    return isinstance(error, ModuleNotFoundError) and error.name == name


def load_fix(error: BaseException | str) -> str:
    """The remedy for an extension file that exists but does not load, from its import error's text."""
    text = str(error)
    if "GLIBC" in text or "GLIBCXX" in text or "CXXABI" in text:
        return ("the extension was built on a newer system than this one (its C / C++ runtime symbol versions are "
                "newer than this system's libraries); install the wheel whose manylinux tag this system meets "
                "(ldd --version gives the glibc) or build here: pip install --force-reinstall --no-deps .")
    if "undefined symbol" in text:
        return ("the extension does not match the installed jax / Python; rebuild it: "
                "pip install --force-reinstall --no-deps .")
    if "cannot open shared object file" in text:
        return "a library the extension links is missing (see the error); reinstall: pip install --force-reinstall ."
    return "reinstall jax_fp4 (pip install --force-reinstall --no-deps .), or build it here from a checkout"


def _state(name: str, module: ModuleType | None, error: BaseException | None) -> dict:
    short = name.rsplit(".", 1)[-1]
    if module is not None:
        return {"state": "loaded", "file": getattr(module, "__file__", None), "error": None, "fix": None}
    files = _files(short)
    if _absent(error, name) and not files:
        return {"state": "absent", "file": None, "error": str(error), "fix": None}
    return {"state": "failed", "file": files[0] if files else None, "error": f"{type(error).__name__}: {error}",
            "fix": load_fix(error)}


_EXT, _IMPORT_ERROR = _load()
_CPU_EXT, _CPU_IMPORT_ERROR = _load("jax_fp4._jax_fp4_cpu")
_STATES = {"cuda": _state("jax_fp4._jax_fp4_cuda", _EXT, _IMPORT_ERROR),
           "cpu": _state("jax_fp4._jax_fp4_cpu", _CPU_EXT, _CPU_IMPORT_ERROR)}


def load_state(which: str) -> dict:
    """How extension `which` ("cuda" or "cpu") loaded: {"state": "loaded" | "absent" | "failed", "file": the
    extension file (None when absent), "error": the import error's text (None when loaded), "fix": the remedy of a
    failed load (None otherwise)}. Raises KeyError for another name."""
    return dict(_STATES[which])


def source_tree() -> bool:
    """Whether jax_fp4 was imported from a source checkout without its compiled extensions (the package directory
    sits next to pyproject.toml and neither extension exists): e.g. `python -m jax_fp4` run from the checkout root,
    whose current directory comes first on sys.path. `python -P` (or another directory) imports the installed one."""
    parent = os.path.dirname(_PKG_DIR)
    return (os.path.exists(os.path.join(parent, "pyproject.toml")) and os.path.isdir(os.path.join(parent, "cpp"))
            and _STATES["cpu"]["state"] == "absent" and _STATES["cuda"]["state"] == "absent")


def _cuda_plugin_installed() -> bool:
    for dist in CUDA_PLUGINS:
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def startup_warning(cuda: dict, cpu: dict, *, cuda_plugin: bool, in_source_tree: bool) -> str | None:
    """The one import-time warning for these load states (`load_state`), or None when nothing fixable is missing.

    Args:
      cuda, cpu: `load_state("cuda")`, `load_state("cpu")`.
      cuda_plugin: a jax CUDA plugin is installed (JAX may run on a GPU here).
      in_source_tree: `source_tree()`.
    """
    for which, st in (("CUDA", cuda), ("CPU", cpu)):
        if st["state"] == "failed":
            return (f"jax_fp4: the {which} extension {st['file'] or ''} exists but does not load ({st['error']}); "
                    f"its ops run the pure-JAX reference (same results, slower). Fix: {st['fix']}")
    if in_source_tree:
        return (f"jax_fp4: imported from the source tree {os.path.dirname(_PKG_DIR)} (no compiled extensions), so "
                "every op runs the pure-JAX reference (same results, slower, long compiles). To use an installed "
                "jax_fp4, run Python with -P (python -P -m ...) or from another directory; to build one: "
                "pip install \".[examples,test]\"")
    if cpu["state"] == "absent":
        return ("jax_fp4: this install has no CPU extension; the CPU runs the pure-JAX reference (same results, "
                "slower). Reinstall from a checkout: pip install .")
    if cuda["state"] == "absent" and cuda_plugin:
        return ("jax_fp4: a jax CUDA plugin is installed but jax_fp4 was built without its CUDA extension (no nvcc at "
                "build time, or JAX_FP4_CUDA=OFF), so GPUs run the pure-JAX reference (same results, no custom CUDA "
                "kernels). Reinstall with nvcc (CUDA >= 12.8) on PATH, e.g. JAX_FP4_CUDA=ON pip install .")
    return None

#: True when the CUDA extension imported; the CUDA lowerings are then registered for platform "cuda".
HAS_CUDA_KERNELS: bool = _EXT is not None
#: True when the CPU extension imported; its targets are then registered for platform "cpu".
HAS_CPU_KERNELS: bool = _CPU_EXT is not None

_lock = threading.Lock()


def extension() -> ModuleType | None:
    """The loaded extension module, or None."""
    return _EXT


def import_error() -> BaseException | None:
    """Why the extension did not import (None when it did)."""
    return _IMPORT_ERROR


_registered: dict[str, tuple[str, ...]] = {}  # platform -> the targets registered for it


def _register(ext: ModuleType | None, platform: str) -> bool:
    """Register every FFI target of `ext` for `platform` once (thread-safe); False when `ext` did not import."""
    if ext is None:
        return False
    with _lock:
        if platform not in _registered:
            regs = ext.registrations()
            for name, capsule in regs.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
            _registered[platform] = tuple(sorted(regs))
    return True


def ensure_registered() -> bool:
    """Register every FFI target of the extension for platform CUDA (idempotent, thread-safe).

    Returns:
      True when the extension is present (its targets are registered), False otherwise.
    """
    return _register(_EXT, "CUDA")


def targets() -> tuple[str, ...]:
    """Names of the registered FFI targets (empty without the extension)."""
    ensure_registered()
    return _registered.get("CUDA", ())


def ensure_cpu_registered() -> bool:
    """Register every FFI target of the CPU extension for platform "cpu" (idempotent, thread-safe).

    Returns:
      True when the CPU extension is present (its targets are registered), False otherwise.
    """
    return _register(_CPU_EXT, "cpu")


def cpu_targets() -> tuple[str, ...]:
    """Names of the FFI targets registered for the CPU (empty without the CPU extension)."""
    ensure_cpu_registered()
    return _registered.get("cpu", ())


def has_cuda_target(*names: str) -> bool:
    """Whether the CUDA extension registered every one of the FFI targets `names`."""
    return ensure_registered() and set(names) <= set(targets())


def has_cpu_target(*names: str) -> bool:
    """Whether the CPU extension registered every one of the FFI targets `names`."""
    return ensure_cpu_registered() and set(names) <= set(cpu_targets())


_reference_on_cpu = 0  # depth of reference_lowering_on_cpu() contexts


@contextlib.contextmanager
def reference_lowering_on_cpu():
    """Within this context the primitives lower to the jnp reference on the CPU even where the CPU extension is built.

    It is the oracle of the GPU tests (the CUDA kernels against `jax_fp4.reference`, not against the host handlers)
    and of `tools/golden/make.py`. jax's compilation caches are cleared on entry and on exit, so no executable
    lowered on one side of the boundary runs on the other. Not thread-safe: meant for tests and tools.
    """
    global _reference_on_cpu
    jax.clear_caches()
    _reference_on_cpu += 1
    try:
        yield
    finally:
        _reference_on_cpu -= 1
        jax.clear_caches()


def cpu_rule(kernel_rule, reference_rule):
    """The lowering rule a primitive registers for platform "cpu": `kernel_rule` (the host handler), or
    `reference_rule` inside `reference_lowering_on_cpu()`."""
    def rule(ctx, *args, **params):
        return (reference_rule if _reference_on_cpu else kernel_rule)(ctx, *args, **params)
    return rule


def cpu_import_error() -> BaseException | None:
    """Why the CPU extension did not import (None when it did)."""
    return _CPU_IMPORT_ERROR


ensure_cpu_registered()
if HAS_CUDA_KERNELS:
    ensure_registered()
_WARNING = startup_warning(_STATES["cuda"], _STATES["cpu"], cuda_plugin=_cuda_plugin_installed(),
                           in_source_tree=source_tree())
if _WARNING is not None:
    warnings.warn(_WARNING, ReferenceOnlyWarning, stacklevel=2)
