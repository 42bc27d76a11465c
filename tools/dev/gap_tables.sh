#!/usr/bin/env bash
# Runs the precision studies behind docs/performance.md ("Measuring gaps", "The gap against model size") on a CUDA
# host, in steps that each end between runs after START_BY seconds (precision_study --start-by), so that a study can
# be cut into jobs of fixed length and continued: a study's finished runs from earlier jobs, copied to
# $PRIOR/<study>/runs, are kept and merged with the new ones.
#   verify   the determinism GPU tests (cuDNN attention with a distinct window per call site included) and the
#            plain-JAX reproducer tools/dev/cudnn_deterministic_repro.py
#   small    study-small: small preset (7.3M), deterministic, XLA attention, 5 runs per GPU
#   medium   study-medium: medium preset (85.5M), deterministic, cuDNN attention, one run per GPU
#   350m     study-350m: large-350m (0.34B), deterministic, cuDNN attention, one run per GPU
#   1b       study-1b: large (1.01B), not deterministic, 2 GPUs per run (the fsdp mesh 1x2x1)
# Each study step writes $OUT/<study>.tgz (its runs without checkpoints or tokenizer, summary.json, gaps.csv,
# gaps.json, gaps.png) and $OUT/<study>.log; `python examples/lm/gap_scaling.py DIR...` draws the unpacked studies.
# Usage, from the repository root: bash tools/dev/gap_tables.sh STEP [STEP ...]
# Environment: SEEDS (default: 0 1 2; 350m 0 1 2 3 4 5; 1b 0 1), CONFIGS (default: the four configurations of the
# tables; 1b the first three), START_BY (seconds, default 240), GPUS (default: every GPU), PRIOR (a directory of
# earlier jobs' unpacked studies); PKG_WHEEL, CUTLASS_WHEEL and REBUILD as in tools/dev/site_package.sh.
set -uo pipefail
R="$PWD"
OUT="${OUT:-/tmp/out}"
START_BY="${START_BY:-240}"
FOUR=nvfp4-fwd-mxfp8-bwd,nvfp4-fwd-mxfp8-bwd+switch0.9,nvfp4+last1+switch0.9,nvfp4-fwd-mxfp8-bwd-4over6
mkdir -p "$OUT" /tmp/studies
# shellcheck source=tools/dev/site_package.sh
source "$R/tools/dev/site_package.sh"
site_package
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
GPU_FLAG=()
[ -n "${GPUS:-}" ] && GPU_FLAG=(--gpus "$GPUS")

study() {  # study NAME PRESET SEEDS CONFIGS [precision_study flags] [-- train_lm flags]
  local name=$1 preset=$2 seeds=$3 configs=$4
  shift 4
  local dir=/tmp/studies/$name
  mkdir -p "$dir/runs"
  [ -n "${PRIOR:-}" ] && [ -d "$PRIOR/$name/runs" ] && cp -rn "$PRIOR/$name/runs/." "$dir/runs/"
  # shellcheck disable=SC2086
  (cd /tmp && python3 -P "$R/examples/lm/precision_study.py" --preset "$preset" --seeds $seeds --configs "$configs" \
    --start-by "$START_BY" "${GPU_FLAG[@]}" --out "$dir" "$@") > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"
  grep -E "^(not started|[a-z0-9+.-]+ +[0-9]+ +[0-9.]+ +[+-])" "$OUT/$name.log" | cut -c1-160
  tar czf "$OUT/$name.tgz" -C /tmp/studies --exclude=checkpoints --exclude=tokenizer "$name"
}

for step in "$@"; do
  case "$step" in
    verify)
      (cd /tmp && timeout 500 python3 -P -m pytest -q -rfs -n 0 -m gpu -p no:cacheprovider \
        "$R/tests/test_determinism.py" "$R/tests/test_train_lm_determinism.py") > "$OUT/verify.log" 2>&1
      echo "verify: rc=$?"; tail -3 "$OUT/verify.log"
      (cd /tmp && timeout 60 python3 -P "$R/tools/dev/cudnn_deterministic_repro.py") 2>&1 | grep -v "^[WI]0"
      ;;
    small) study study-small small "${SEEDS:-0 1 2}" "${CONFIGS:-$FOUR}" --deterministic --per-gpu 5 ;;
    medium) study study-medium medium "${SEEDS:-0 1 2}" "${CONFIGS:-$FOUR}" --deterministic -- --attention cudnn ;;
    350m) study study-350m large-350m "${SEEDS:-0 1 2 3 4 5}" "${CONFIGS:-$FOUR}" --deterministic \
            -- --attention cudnn ;;
    1b) study study-1b large "${SEEDS:-0 1}" \
          "${CONFIGS:-nvfp4-fwd-mxfp8-bwd,nvfp4-fwd-mxfp8-bwd+switch0.9,nvfp4+last1+switch0.9}" --gpus-per-run 2 ;;
    *) echo "unknown step $step (verify, small, medium, 350m, 1b)"; exit 2 ;;
  esac
done
