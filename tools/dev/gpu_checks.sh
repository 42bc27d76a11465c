#!/usr/bin/env bash
# Builds the package into /tmp/site and runs the chosen GPU checks against that install (from /tmp, so the checkout
# is not imported), writing each step's log to $OUT (default /tmp/out) and printing a summary line per step:
#   golden            tools/golden/check.py: kernel outputs against precomputed reference bits (needs
#                     tools/golden/ref.npz from `python -P tools/golden/make.py`)
#   pytest            pytest -m gpu tests
#   sanitize          compute-sanitizer memcheck and racecheck of tools/golden/sanitize.py (racecheck: minutes)
#   sanitize-gemm     memcheck and racecheck of the jf4_gemm calls of tools/golden/sanitize.py alone
#   pytest-gemm       pytest -m gpu of the jf4_gemm tests (tests/test_gemm_kernel.py, tests/test_gemm_primitive.py)
#   bench-quantize, bench-dequantize, bench-dense, bench-amax, bench-gemm   the benchmarks/ tables (JSON to $OUT)
#   bench-dense-routes  benchmarks/dense.py on the jf4_gemm and the emulated route of each quantized recipe
#   ncu-quantize      ncu sections of the NVFP4 row+col quantize kernel at 8192x8192
#   profile-dense     tools/profile_dense.py: a dense step's GPU time by kernel
# Usage, from the repository root on a CUDA machine:
#   bash tools/dev/gpu_checks.sh [STEP ...]   (no arguments: golden pytest sanitize bench-quantize bench-dense bench-amax)
set -uo pipefail
R="$PWD"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(golden pytest sanitize bench-quantize bench-dense bench-amax)
S=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . > "$OUT/build.log" 2>&1
echo "build rc=$? $(( $(date +%s) - S ))s"
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp || exit 1
export PYTHONPATH=/tmp/site
for step in "${steps[@]}"; do
  case "$step" in
    golden) timeout 150 python3 -P "$R/tools/golden/check.py" > "$OUT/golden.log" 2>&1; tail -1 "$OUT/golden.log";
            grep -E "^(BAD|ERR)" "$OUT/golden.log" | head -20 ;;
    pytest) timeout 400 python3 -P -m pytest -q -rf -m gpu -p no:cacheprovider "$R/tests" > "$OUT/pytest.log" 2>&1;
            tail -5 "$OUT/pytest.log" ;;
    sanitize-gemm) for tool in memcheck racecheck; do
                     timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 -P \
                       "$R/tools/golden/sanitize.py" --gemm-only > "$OUT/san_gemm_$tool.log" 2>&1
                     echo "$tool rc=$? $(tail -1 "$OUT/san_gemm_$tool.log")"
                   done ;;
    pytest-gemm) timeout 500 python3 -P -m pytest -q -rf -m gpu -p no:cacheprovider "$R/tests/test_gemm_kernel.py" \
                   "$R/tests/test_gemm_primitive.py" > "$OUT/pytest_gemm.log" 2>&1; tail -5 "$OUT/pytest_gemm.log" ;;
    sanitize) for tool in memcheck racecheck; do
                timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 python3 -P "$R/tools/golden/sanitize.py" \
                  > "$OUT/san_$tool.log" 2>&1
                echo "$tool rc=$? $(tail -1 "$OUT/san_$tool.log")"
              done ;;
    bench-quantize) timeout 200 python3 -P "$R/benchmarks/quantize.py" --iters 10 --repeats 2 \
                      --out "$OUT/quantize.json" > "$OUT/bench_quantize.log" 2>&1; tail -45 "$OUT/bench_quantize.log" ;;
    bench-dequantize) timeout 300 python3 -P "$R/benchmarks/dequantize.py" --iters 10 --repeats 2 \
                        --out "$OUT/dequantize.json" > "$OUT/bench_dequantize.log" 2>&1; tail -50 "$OUT/bench_dequantize.log" ;;
    bench-dense) timeout 300 python3 -P "$R/benchmarks/dense.py" --out "$OUT/dense.json" > "$OUT/bench_dense.log" 2>&1;
                 tail -25 "$OUT/bench_dense.log" ;;
    ncu-quantize) timeout 240 ncu --kernel-name regex:QuantizeKernel --launch-skip 2 --launch-count 1 \
                    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
                    --section InstructionStats --section MemoryWorkloadAnalysis python3 -P "$R/benchmarks/quantize.py" \
                    --shapes 8192x8192 --variants nvfp4_rowcol --iters 2 --repeats 1 \
                    --out "$OUT/ncu_bench.json" > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"; grep -E "Duration|Throughput|Issue|Executed Ipc|Stall|Registers|Achieved Occ" "$OUT/ncu.log" | head -40 ;;
    profile-dense) timeout 300 python3 -P "$R/tools/profile_dense.py" --recipes bf16,mxfp8,nvfp4-fwd-mxfp8-bwd,nvfp4 \
                     --json "$OUT/profile_dense.json" > "$OUT/profile_dense.log" 2>&1; echo "profile rc=$?";
                   grep -A8 "^== " "$OUT/profile_dense.log" ;;
    bench-gemm) timeout 500 python3 -P "$R/benchmarks/gemm.py" --out "$OUT/gemm.json" > "$OUT/bench_gemm.log" 2>&1;
                tail -45 "$OUT/bench_gemm.log" ;;
    bench-dense-routes) timeout 550 python3 -P "$R/benchmarks/dense.py" --implementations kernel,emulated \
                          --recipes mxfp8,nvfp4-fwd-mxfp8-bwd,nvfp4-1x64 --out "$OUT/dense_routes.json" \
                          > "$OUT/bench_dense_routes.log" 2>&1; tail -30 "$OUT/bench_dense_routes.log" ;;
    bench-amax) timeout 100 python3 -P "$R/benchmarks/amax.py" --out "$OUT/amax.json" > "$OUT/bench_amax.log" 2>&1;
                tail -8 "$OUT/bench_amax.log" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "$step done $(( $(date +%s) - S ))s"
done
