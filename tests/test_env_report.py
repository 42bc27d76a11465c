"""`jax_fp4.__version__` (one source: jax_fp4/_version.py, read by pyproject.toml), CHANGELOG.md, and the environment
report of `python -m jax_fp4` on the CPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

import jax_fp4
from jax_fp4 import env
from jax_fp4 import route as route_module
from jax_fp4._src import ffi
from jax_fp4.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[1]


def test_version_single_source():
    assert re.fullmatch(r"\d+\.\d+\.\d+", jax_fp4.__version__)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"] and "version" not in pyproject["project"]
    meta = pyproject["tool"]["scikit-build"]["metadata"]["version"]
    assert meta["input"] == "jax_fp4/_version.py"
    assert f'__version__ = "{jax_fp4.__version__}"' in (ROOT / meta["input"]).read_text()
    if not Path(jax_fp4.__file__).resolve().is_relative_to(ROOT):  # an installed package (README: -P) has metadata
        assert importlib.metadata.version("jax_fp4") == jax_fp4.__version__


def test_changelog_top_entry_is_the_version():
    """The top released entry is the version; an "Unreleased" entry may sit above it (changes not yet released)."""
    heads = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    released = heads[1:] if heads[0] == "Unreleased" else heads
    assert released[0] == jax_fp4.__version__ and "0.1.0" in released and "Unreleased" not in released


def test_env_report_on_the_cpu():
    r = jax_fp4.env_report()
    json.dumps(r)  # plain data
    assert r["jax_fp4"] == jax_fp4.__version__
    assert r["packages"]["jax"] == jax.__version__ and r["packages"]["jaxlib"] == importlib.metadata.version("jaxlib")
    assert set(env.PLUGIN_PACKAGES) <= set(r["packages"])
    assert r["cuda_extension"]["built"] == ffi.HAS_CUDA_KERNELS
    if ffi.HAS_CUDA_KERNELS:  # built with CMakeLists.txt's --generate-code list
        assert r["cuda_extension"]["architectures"] == ["sm_90a", "sm_100a", "compute_90"]
    else:
        assert r["cuda_extension"]["architectures"] == [] and r["cuda_extension"]["error"]
    assert r["cpu_kernels"]["built"] == bool(getattr(ffi, "HAS_CPU_KERNELS", False))
    assert r["device"]["platform"] == "cpu" and r["device"]["compute_capability"] is None
    assert r["kernels"] == ("CPU kernels" if r["cpu_kernels"]["built"] else "reference")
    assert r["native_gemm"] == {"auto": False, "on_request": route_module.scaled_matmul_lowers()}
    assert set(r["recipes"]) == set(RECIPES)
    assert r["recipes"]["bf16"] == {"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"}
    for name in set(RECIPES) - {"bf16"}:
        assert r["recipes"][name] == {"fprop": "emulated", "dgrad": "emulated", "wgrad": "emulated"}, name
    text = env.format_env_report(r)
    assert text.splitlines()[0].startswith(f"jax_fp4 {jax_fp4.__version__} ")
    assert f"jax {jax.__version__}" in text and "device: cpu" in text
    for name in RECIPES:
        assert re.search(rf"^  {re.escape(name)} +(bf16|emulated) +(bf16|emulated) +(bf16|emulated)$", text, re.M)


def test_env_report_routes_on_compute_capability_10(monkeypatch):
    """The report reads the routes from jax_fp4.route: with block-scaled tensor cores, MXFP8 GEMMs and NVFP4 1D x 1D
    go native; 2D weights, RHT and 1x64 stay emulated."""
    monkeypatch.setattr(route_module, "native_gemm_available", lambda: True)
    routes = env.env_report()["recipes"]
    assert routes["mxfp8"] == {"fprop": "native", "dgrad": "native", "wgrad": "native"}
    assert routes["nvfp4"] == {"fprop": "emulated", "dgrad": "emulated", "wgrad": "emulated"}  # 2D w, RHT wgrad
    assert routes["nvfp4-fwd-mxfp8-bwd"] == {"fprop": "native", "dgrad": "native", "wgrad": "native"}
    assert routes["nvfp4-1x64"] == {"fprop": "emulated", "dgrad": "native", "wgrad": "native"}
    assert env.env_report()["native_gemm"]["auto"]


@pytest.mark.parametrize("built", [False, True])
def test_cuda_extension_entry(monkeypatch, built):
    class Ext:
        cuda_architectures = ("sm_90a", "sm_100a", "compute_90")
        cuda_compiler_version = "13.0.88"

    monkeypatch.setattr(ffi, "extension", lambda: Ext() if built else None)
    entry = env.env_report()["cuda_extension"]
    if built:
        assert {k: entry[k] for k in ("built", "state", "architectures", "cuda_compiler", "error", "fix")} == {
            "built": True, "state": "loaded", "architectures": ["sm_90a", "sm_100a", "compute_90"],
            "cuda_compiler": "13.0.88", "error": None, "fix": None}
        assert "CUDA extension: built for sm_90a, sm_100a, compute_90 (nvcc 13.0.88)" in env.format_env_report()
    else:
        assert not entry["built"] and "CUDA extension: not built" in env.format_env_report()


def test_python_m_jax_fp4():
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(jax_fp4.__file__).parents[1])] + sys.path))
    out = subprocess.run([sys.executable, "-m", "jax_fp4"], capture_output=True, text=True, env=environ,
                         cwd=ROOT / "tests", timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"jax_fp4 {jax_fp4.__version__} ")
    assert "GEMM route per recipe" in out.stdout


_LOADED = {"state": "loaded", "file": "x.so", "error": None, "fix": None}
_ABSENT = {"state": "absent", "file": None, "error": "No module named 'jax_fp4._jax_fp4_cuda'", "fix": None}
_GLIBC = "ImportError: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.38' not found (required by _jax_fp4_cuda.so)"


def _failed(error=_GLIBC):
    return {"state": "failed", "file": "/site/jax_fp4/_jax_fp4_cuda.so", "error": error, "fix": ffi.load_fix(error)}


def test_startup_warning_matches_what_is_missing():
    """Importing warns only where something fixable is missing: a CPU-only install with its CPU kernels is silent; a
    jax CUDA plugin without the CUDA extension names nvcc / JAX_FP4_CUDA; a file that fails to load gives its error
    and fix; a source checkout gives the -P remedy."""
    sw = ffi.startup_warning
    assert sw(_ABSENT, _LOADED, cuda_plugin=False, in_source_tree=False) is None
    assert sw(_LOADED, _LOADED, cuda_plugin=True, in_source_tree=False) is None
    gpu = sw(_ABSENT, _LOADED, cuda_plugin=True, in_source_tree=False)
    assert "nvcc" in gpu and "JAX_FP4_CUDA=ON" in gpu and "GPU" in gpu
    bad = sw(_failed(), _LOADED, cuda_plugin=False, in_source_tree=False)
    assert "GLIBC_2.38" in bad and "does not load" in bad and "manylinux" in bad and "nvcc" not in bad
    src = sw(_ABSENT, _ABSENT, cuda_plugin=False, in_source_tree=True)
    assert "source tree" in src and "-P" in src and "nvcc" not in src
    assert "reinstall" in sw(_ABSENT, _ABSENT, cuda_plugin=False, in_source_tree=False).lower()
    assert sw(_ABSENT, _failed("ImportError: undefined symbol: _ZN3xla3ffi"), cuda_plugin=False,
              in_source_tree=False).count("undefined symbol") == 1


def test_load_fix_by_error():
    assert "manylinux" in ffi.load_fix(_GLIBC) and "pip install --force-reinstall" in ffi.load_fix(_GLIBC)
    assert "jax" in ffi.load_fix("undefined symbol: XLA_FFI_Foo")
    assert "missing" in ffi.load_fix("libfoo.so: cannot open shared object file")


def test_this_install_imports_silently_when_nothing_is_missing():
    """The import-time warning of this process is the one `startup_warning` gives for its load states."""
    expected = ffi.startup_warning(ffi.load_state("cuda"), ffi.load_state("cpu"),
                                   cuda_plugin=ffi._cuda_plugin_installed(), in_source_tree=ffi.source_tree())
    assert ffi._WARNING == expected
    if ffi.HAS_CPU_KERNELS and not ffi._cuda_plugin_installed():
        assert ffi._WARNING is None


def test_report_gives_a_failed_load_and_its_fix(monkeypatch):
    monkeypatch.setattr(ffi, "extension", lambda: None)
    monkeypatch.setitem(ffi._STATES, "cuda", _failed())
    r = env.env_report()
    assert r["cuda_extension"]["state"] == "failed" and "GLIBC_2.38" in r["cuda_extension"]["error"]
    line = next(ln for ln in env.format_env_report(r).splitlines() if ln.startswith("CUDA extension:"))
    assert "FAILED TO LOAD" in line and "GLIBC_2.38" in line and "manylinux" in line and "not built" not in line


def test_report_says_when_it_reads_a_source_tree(monkeypatch, tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "cpp").mkdir()
    monkeypatch.setattr(ffi, "_PKG_DIR", str(tmp_path / "jax_fp4"))
    monkeypatch.setitem(ffi._STATES, "cpu", _ABSENT)
    monkeypatch.setitem(ffi._STATES, "cuda", _ABSENT)
    assert ffi.source_tree()
    r = env.env_report()
    assert r["package"]["source_tree"]
    text = env.format_env_report(r)
    assert "SOURCE TREE" in text and "python -P -m jax_fp4" in text
    monkeypatch.setitem(ffi._STATES, "cpu", _LOADED)  # an editable install: the extensions load
    assert not ffi.source_tree() and not env.env_report()["package"]["source_tree"]


def test_an_extension_file_that_does_not_load_is_reported(tmp_path):
    """A package whose CUDA extension file exists but is not loadable (here: not an ELF file at all, as a wheel
    built for a newer glibc fails at the loader): importing warns once with the load error and the fix, and the
    report says FAILED TO LOAD instead of "not built"."""
    import importlib.machinery
    import shutil
    import textwrap

    src = Path(jax_fp4.__file__).resolve().parent
    pkg = tmp_path / "jax_fp4"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    (pkg / ("_jax_fp4_cuda" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not an ELF file")
    code = textwrap.dedent(
        f"""
        import sys, warnings
        # (an editable install's import hook would take precedence over PYTHONPATH)
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import jax_fp4
        assert jax_fp4.__file__.startswith({str(tmp_path)!r}), "SKIP " + jax_fp4.__file__
        msgs = [str(x.message) for x in w if issubclass(x.category, jax_fp4.ReferenceOnlyWarning)]
        assert len(msgs) == 1 and "exists but does not load" in msgs[0] and "Fix:" in msgs[0], msgs
        from jax_fp4 import env
        line = next(ln for ln in env.format_env_report().splitlines() if ln.startswith("CUDA extension:"))
        assert "FAILED TO LOAD" in line and "fix:" in line, line
        print("OK")
        """
    )
    environ = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=environ,
                         cwd=tmp_path, timeout=300)
    if "SKIP" in out.stderr:  # an editable install's import hook took precedence over PYTHONPATH
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_python_m_jax_fp4_from_a_checkout_root_names_the_source_tree(tmp_path):
    """`python -m jax_fp4` run from a checkout root imports the source tree (the current directory comes first on
    sys.path): the report says so and gives the -P remedy, and importing warns once with the same remedy."""
    import shutil
    import textwrap

    src = Path(jax_fp4.__file__).resolve().parent
    shutil.copytree(src, tmp_path / "jax_fp4", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "cpp").mkdir()
    code = textwrap.dedent(
        """
        import runpy, sys, warnings
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            runpy.run_module("jax_fp4", run_name="__main__")
        print("WARNINGS", [str(x.message) for x in w if "source tree" in str(x.message)])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    assert "SOURCE TREE" in out.stdout and "python -P -m jax_fp4" in out.stdout, out.stdout
    assert "WARNINGS ['jax_fp4: imported from the source tree" in out.stdout and "-P" in out.stdout
