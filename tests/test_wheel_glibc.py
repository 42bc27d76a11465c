"""tools/check_wheel_glibc.py: a wheel whose shared objects need a newer glibc than its manylinux tag is refused."""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path

import pytest

from jax_fp4._src import ffi

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_wheel_glibc", ROOT / "tools" / "check_wheel_glibc.py")
cwg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cwg)


def test_tag_glibc():
    assert cwg.tag_glibc("jax_fp4-0.2.0-cp312-cp312-manylinux_2_34_x86_64.whl") == (2, 34)
    assert cwg.tag_glibc("a-1-cp311-cp311-manylinux2014_x86_64.whl") == (2, 17)
    assert cwg.tag_glibc("a-1-cp311-cp311-manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl") == (2, 17)
    assert cwg.tag_glibc("a-1-cp311-cp311-linux_x86_64.whl") is None


def _elf() -> str | None:
    """A shared object linked against glibc: the CPU extension, else numpy's compiled core."""
    f = ffi.load_state("cpu")["file"]
    if f and f.endswith(".so"):
        return f
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    f = getattr(core._multiarray_umath, "__file__", None)
    return f if f and f.endswith(".so") else None


@pytest.mark.skipif(shutil.which("readelf") is None or _elf() is None, reason="needs readelf and a shared object")
def test_wheel_refused_below_its_symbols(tmp_path):
    so = _elf()
    need = cwg.required_glibc(so)
    assert need is not None and need >= (2, 2)

    def wheel(major, minor):
        path = tmp_path / f"jax_fp4-0.0.0-cp3-cp3-manylinux_{major}_{minor}_x86_64.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.write(so, "jax_fp4/" + Path(so).name)
        return str(path)

    assert cwg.check_wheel(wheel(*need)) == []
    assert cwg.main([wheel(*need)]) == 0
    low = wheel(need[0], need[1] - 1)
    (msg,) = cwg.check_wheel(low)
    assert f"GLIBC_{need[0]}.{need[1]}" in msg and f"glibc {need[0]}.{need[1] - 1}" in msg
    assert cwg.main([low]) == 1
