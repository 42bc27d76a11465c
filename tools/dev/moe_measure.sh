#!/usr/bin/env bash
# Builds the package into /tmp/site and trains the moe-large preset (examples/lm/train_lm.py) with bf16 and
# nvfp4-fwd-mxfp8-bwd on the chosen meshes, writing each run's log and output directory to $OUT (default /tmp/out)
# and printing per recipe: tokens/s, the nvfp4-fwd-mxfp8-bwd / bf16 ratio, MFU (model FLOPs of the active
# parameters), peak memory per device, compile time and the compiled step's all-to-all bytes (--collectives).
#   ep2       --mesh 1x1x1x2 (2 GPUs: 32 experts each, quantized dispatch for nvfp4-fwd-mxfp8-bwd), dropless
#   ep2-cf    --mesh 1x1x1x2 --capacity-factor 1.25
#   one       no mesh: one GPU, experts replicated (the one-GPU ratio)
#   ep2-tokamax, one-tokamax, ep2-tokamax-cf   ep2 / one / ep2-cf with --grouped-gemm tokamax (tokamax's GPU
#             grouped-GEMM kernels)
#   ep2-cudnn ep2 with XLA's cuDNN ragged-dot fusion (--xla_gpu_experimental_use_ragged_dot_fusion=true)
#   ep4       --mesh 1x1x1x4 (4 GPUs)          dx4 --mesh 2x1x1x2 (4 GPUs: data x expert)
#   profile   tools/profile_train.py of ep2 (kernel time by category, nccl exposed)
#   fidelity  the small preset with --moe (8 experts, top-2) on one GPU, bf16 and nvfp4-fwd-mxfp8-bwd, seeds 0 1 2,
#             300 steps: gaps.csv / gaps.json (each seed's gap to bf16, mean and spread)
# Usage, from the repository root on a CUDA machine: bash tools/dev/moe_measure.sh [STEP ...] (default: ep2 one)
# Environment: STEPS (default 30) sets --steps; RECIPES (default bf16,nvfp4-fwd-mxfp8-bwd) the recipes of each run
# (one recipe per call keeps a call short); /tmp/site is reused when it holds a build (REBUILD=1 rebuilds); XLA_FLAGS
# pass through (e.g. --xla_gpu_experimental_use_ragged_dot_fusion=true where the jaxlib has cuDNN's ragged dot).
# CUTLASS_WHEEL=FILE builds against that nvidia-cutlass wheel (a machine without a package index; else from PyPI).
# PKG_WHEEL=FILE installs that jax_fp4 wheel instead of building (~95 s saved per fresh machine; a cp312 wheel with
# the CUDA extension: tools/build_wheels.sh OUT python3.12, a few minutes on two cores without a GPU).
# WHEELS=DIR installs the wheels in DIR (--no-index --no-deps) into /tmp/extra, on PYTHONPATH after /tmp/site: the
# tokamax steps need, on a machine without a package index, the tokamax release that matches its jax (0.0.12 for jax
# 0.10, >= 0.0.13 for jax >= 0.11: docs/design.md) and what it imports that the machine lacks (for 0.0.17 on jax
# 0.11.2: einshape, pydantic, pydantic-core, annotated-types, typing-inspection, immutabledict, qwix, tensorboardx,
# xprof, fire, termcolor, gviz-api).
set -uo pipefail
R="$PWD"
OUT="${OUT:-/tmp/out}"
STEPS="${STEPS:-30}"
RECIPES="${RECIPES:-bf16,nvfp4-fwd-mxfp8-bwd}"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(ep2 one)
# shellcheck source=tools/dev/site_package.sh
source "$R/tools/dev/site_package.sh"
site_package
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1
  echo "wheels rc=$?"
fi
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp || exit 1
export PYTHONPATH=/tmp/site${WHEELS:+:/tmp/extra}
COMMON=(--preset moe-large --recipes "$RECIPES" --steps "$STEPS" --eval-every "$STEPS" --eval-batches 2
        --log-every 10 --no-progress --collectives)
summary() {  # tokens/s, ratio, MFU, peak, compile, all-to-all bytes of $OUT/$1/summary.json
  python3 - "$OUT/$1/summary.json" "$1" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
bf = s.get("bf16", {}).get("tokens_per_s")
for name, r in s.items():
    a2a = (r.get("collectives") or {}).get("all-to-all", {})
    peak = r.get("peak_bytes_per_device")
    peak = max(peak) if isinstance(peak, list) else peak
    print(f"{sys.argv[2]:>8} {name:<20} tok/s {r['tokens_per_s']:>9,.0f}  x bf16 "
          f"{r['tokens_per_s'] / bf if bf else float('nan'):.3f}  MFU {r.get('mfu') or float('nan'):.3f}  peak "
          f"{(peak or 0) / 2**30:.1f} GiB  compile {r.get('compile_s') or float('nan'):.1f} s  all-to-all "
          f"{a2a.get('count_per_step', 0)} x, {a2a.get('bytes_per_step', 0) / 2**20:.1f} MiB/step  val "
          f"{r['val_loss']:.4f}  max load {max(r.get('expert_load') or [float('nan')]):.4f}")
EOF
}
run() {  # name, extra train_lm flags...
  local name="$1"; shift
  # the run directory stays outside $OUT (its checkpoints: ~20 GB per recipe, deleted after the run), one BPE cache
  mkdir -p "/tmp/moe_runs/$name" "$OUT/$name" /tmp/moe_tokenizer
  ln -sfn /tmp/moe_tokenizer "/tmp/moe_runs/$name/tokenizer"
  timeout 560 python3 -P "$R/examples/lm/train_lm.py" "${COMMON[@]}" "$@" --out "/tmp/moe_runs/$name" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -m1 -iE "out of memory|RESOURCE_EXHAUSTED" "$OUT/$name.log")"
  cp /tmp/moe_runs/$name/summary.json /tmp/moe_runs/$name/curves.csv "$OUT/$name/" 2>/dev/null
  rm -rf "/tmp/moe_runs/$name/checkpoints"
  summary "$name" || tail -20 "$OUT/$name.log"
}
for step in "${steps[@]}"; do
  case "$step" in
    ep2) run ep2 --mesh 1x1x1x2 ;;
    ep2-cf) run ep2-cf --mesh 1x1x1x2 --capacity-factor 1.25 ;;
    one) run one ;;
    ep2-tokamax) python3 -P -c "from tokamax._src.ops.ragged_dot import api; print('tokamax ragged_dot:', \
                   sorted(api.IMPLEMENTATIONS))"  # the implementations that imported here (a private table)
                 run ep2-tokamax --mesh 1x1x1x2 --grouped-gemm tokamax ;;
    one-tokamax) run one-tokamax --grouped-gemm tokamax ;;
    ep2-tokamax-cf) run ep2-tokamax-cf --mesh 1x1x1x2 --grouped-gemm tokamax --capacity-factor 1.25 ;;
    ep2-cudnn) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_use_ragged_dot_fusion=true" run ep2-cudnn --mesh 1x1x1x2 ;;
    ep4) run ep4 --mesh 1x1x1x4 ;;
    dx4) run dx4 --mesh 2x1x1x2 ;;
    profile) mkdir -p /tmp/profile_run /tmp/moe_tokenizer; ln -sfn /tmp/moe_tokenizer /tmp/profile_run/tokenizer
             timeout 560 python3 -P "$R/tools/profile_train.py" --out "$OUT/profile_ep2.json" -- "${COMMON[@]}" \
               --mesh 1x1x1x2 --steps 8 --eval-every 8 --eval-batches 1 --out /tmp/profile_run \
               > "$OUT/profile_ep2.log" 2>&1; echo "profile rc=$?"; tail -30 "$OUT/profile_ep2.log" ;;
    fidelity) timeout 560 python3 -P "$R/examples/lm/train_lm.py" --preset small --moe --steps 300 --no-progress \
                --recipes bf16,nvfp4-fwd-mxfp8-bwd --seeds 0 1 2 --out "$OUT/fidelity" > "$OUT/fidelity.log" 2>&1
              echo "fidelity rc=$?"; rm -rf "$OUT/fidelity/checkpoints"; tail -25 "$OUT/fidelity.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
