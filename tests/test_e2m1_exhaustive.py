"""Host build of cpp/common/e2m1.cuh (the kernels' E2M1 encoder) checked against the threshold definitions of
docs/numerics.md: RNE on every fp32 bit pattern, stochastic rounding on every random byte for 3 * 2^20 patterns, and the
8-value packer on random inputs (tests/cpp/e2m1_check.cc). Needs a C++17 compiler; skipped without one."""

import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow  # every fp32 bit pattern through the encoder's host build (~85 s): full suite only

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("e2m1") / "e2m1_check"
    # -ffp-contract=off: the host must not fuse the definitions' products into FMAs either.
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{ROOT / 'cpp'}",
                    str(ROOT / "tests" / "cpp" / "e2m1_check.cc"), "-o", str(exe)], check=True)
    return exe


def test_e2m1_encoder_matches_definitions(checker):
    r = subprocess.run([str(checker)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.startswith("ok ")
