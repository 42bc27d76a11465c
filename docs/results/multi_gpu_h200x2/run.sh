set -u
cd .devstage; R=$PWD; S=$(date +%s); el() { echo $(( $(date +%s) - S )); }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . > $OUT/build.log 2>&1; echo "build rc=$? $(el)s"
for m in optax tqdm matplotlib orbax.checkpoint; do python3 -c "import $m" 2>/dev/null || echo "MISSING $m"; done
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/extra wheels/*.whl > $OUT/wheels.log 2>&1
python3 -c "import orbax.checkpoint" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/extra wheels/orbax/*.whl >> $OUT/wheels.log 2>&1
cd /tmp; export PYTHONPATH=/tmp/site:/tmp/extra
A="--preset small --steps 200 --eval-every 200 --log-every 10 --no-progress --ckpt-every 100000"
for r in bf16 nvfp4-fwd-mxfp8-bwd; do
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -P $R/examples/train_lm.py --recipe $r $A --out $OUT/g1_$r > $OUT/g1_$r.log 2>&1; echo "1gpu $r rc=$? $(el)s"
  for mesh in 2x1 1x2; do
    timeout 110 python3 -P $R/examples/train_lm.py --recipe $r $A --mesh $mesh --out $OUT/m${mesh}_$r > $OUT/m${mesh}_$r.log 2>&1; echo "mesh $mesh $r rc=$? $(el)s"
  done
done
for f in $OUT/*.log; do echo "== $f"; grep -E "^\| |tokens/s|mesh|val" $f | tail -4; done
