#!/usr/bin/env bash
# Grouped-quantize A/B on a CUDA machine (a kernel-development tool): builds tools/dev/kernel_check/grouped_check.cu
# against the kernel headers of OLD (a directory holding an earlier revision's cpp/ and its harness directory, e.g. from
# `git archive REV cpp tools`; revisions before the tools/dev/ layout keep it in tools/kernel_check/) and of the
# working tree, checks every output byte of the new build against
# the old one's, times both in alternating rounds, and optionally profiles one case of each with ncu (per-instruction
# executed counts of the SASS; summarise them with tools/dev/kernel_check/sass_counts.py). Logs go to $OUT.
# Usage (repository root): bash tools/dev/kernel_check/grouped_ab.sh OLD_DIR "VARIANT SUBSTRING" ROUNDS ["NCU VARIANT"]
# ("" times every variant; the ncu profiles: 16384 x 4096 with 1 and 64 groups, and the single-tensor kernel at 8192^2)
set -uo pipefail
OLD="$1"; ONLY="$2"; ROUNDS="${3:-2}"; NCU="${4:-}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
FLAGS=(-std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -ftz=false)
# EXTRA="DIR ..." (optional): more builds (trees like OLD_DIR, named by their last path component), checked and timed
# beside new.
BUILDS=(old new)
harness() { if [ -d "$1/tools/dev/kernel_check" ]; then echo "$1/tools/dev/kernel_check"; else echo "$1/tools/kernel_check"; fi; }
H=$(harness "$OLD")
nvcc "${FLAGS[@]}" -I"$OLD/cpp" -I"$H" -o /tmp/g_old "$H/grouped_check.cu" &
nvcc "${FLAGS[@]}" -Icpp -o /tmp/g_new tools/dev/kernel_check/grouped_check.cu &
for d in ${EXTRA:-}; do
  b=$(basename "$d"); BUILDS+=("$b"); H=$(harness "$d")
  nvcc "${FLAGS[@]}" -I"$d/cpp" -I"$H" -o "/tmp/g_$b" "$H/grouped_check.cu" &
done
wait
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/ref
/tmp/g_old dump /tmp/ref > "$OUT/dump.log" 2>&1; echo "dump rc=$?"
for v in "${BUILDS[@]:1}"; do
  /tmp/g_$v compare /tmp/ref >> "$OUT/compare.log" 2>&1; echo "compare $v rc=$? $(tail -1 "$OUT/compare.log")"
done
for r in $(seq 1 "$ROUNDS"); do
  for v in "${BUILDS[@]}"; do
    echo "== $v round $r" >> "$OUT/time.log"
    /tmp/g_$v time "$ONLY" >> "$OUT/time.log" 2>&1
  done
done
python3 tools/dev/kernel_check/ab_table.py "$OUT/time.log" 2>/dev/null | tee "$OUT/time_table.txt" || grep -E "==|copy|%" "$OUT/time.log"
if [ -n "$NCU" ]; then
  for v in old new; do
    for skip in 2 128; do
      timeout 120 ncu --kernel-name regex:GroupedQuantizeKernel --launch-skip $skip --launch-count 1 \
        --section SourceCounters --section InstructionStats --section WarpStateStats --section LaunchStats \
        --section SpeedOfLight -f -o /tmp/ncu_${v}_$skip /tmp/g_$v time "$NCU" > /dev/null 2>&1
      ncu -i /tmp/ncu_${v}_$skip.ncu-rep --page source --csv --print-source sass > "$OUT/sass_${v}_$skip.csv" 2>&1
      ncu -i /tmp/ncu_${v}_$skip.ncu-rep --page details >> "$OUT/ncu_details.txt" 2>&1
    done
  done
fi
if [ -n "$NCU" ]; then  # the single-tensor kernel of the same pairing at 8192^2 (as many elements as 16384 x 4096)
  nvcc "${FLAGS[@]}" -Icpp -o /tmp/q_new tools/dev/kernel_check/quantize_check.cu &&
  timeout 120 ncu --kernel-name regex:QuantizeKernel --launch-count 1 --section SourceCounters --section InstructionStats \
    --section WarpStateStats --section LaunchStats --section SpeedOfLight -f -o /tmp/ncu_single /tmp/q_new profile \
    "$NCU" > /dev/null 2>&1
  ncu -i /tmp/ncu_single.ncu-rep --page source --csv --print-source sass > "$OUT/sass_single.csv" 2>&1
  ncu -i /tmp/ncu_single.ncu-rep --page details >> "$OUT/ncu_details.txt" 2>&1
fi
# everything in one archive, the table beside it
(cd "$OUT" && tar czf ab.tgz compare.log time.log ncu_details.txt ./*.csv 2>/dev/null; rm -f ./*.csv dump.log compare.log \
  time.log ncu_details.txt)
