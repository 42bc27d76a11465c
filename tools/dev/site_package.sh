#!/usr/bin/env bash
# Sourced by the measurement scripts of tools/dev: puts jax_fp4 into /tmp/site, from the repository root.
# /tmp/site is reused when it holds a package (unless REBUILD is set); PKG_WHEEL=FILE installs that jax_fp4 wheel
# (a cp312 wheel with the CUDA extension: tools/build_wheels.sh); else the package is built against the nvidia-cutlass
# wheel CUTLASS_WHEEL (default: nvidia-cutlass==4.2.0.0 from PyPI). Logs go to $OUT/build.log and $OUT/cutlass.log.
site_package() {
  local start
  start=$(date +%s)
  if [ -d /tmp/site/jax_fp4 ] && [ -z "${REBUILD:-}" ]; then
    echo "package: reusing /tmp/site"
  elif [ -n "${PKG_WHEEL:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$PKG_WHEEL" > "$OUT/build.log" 2>&1
    echo "wheel rc=$? $(( $(date +%s) - start ))s"
  else
    python3 -m pip install -q --no-deps --target /tmp/cutlass "${CUTLASS_WHEEL:-nvidia-cutlass==4.2.0.0}" \
      > "$OUT/cutlass.log" 2>&1
    PYTHONPATH=/tmp/cutlass python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . \
      > "$OUT/build.log" 2>&1
    echo "build rc=$? $(( $(date +%s) - start ))s"
  fi
}
