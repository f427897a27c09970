#!/usr/bin/env bash
# The sd15 GPU tables of BENCHMARKS.md in one run, for a lent H200 (the workplace's `device` tool).
#
# That machine has torch and transformers but not diffusers, and cannot reach the network: carry the wheels.
# Once, here, in the repository root (Python 3.12 there):
#   echo /.whl/ >> .git/info/exclude
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 importlib_metadata zipp pillow
# (about 14 MB; .whl/ is ignored by git, so it stays in the checkout that downloaded it)
# Then one device call (carry `.whl`, timeout_s 560), with the commit this tree is at:
#   COMMIT=<short hash> bash benchmarks/gpu.sh          # the bench tables; `step`: the whole iteration; `all`
# Everything lands in $OUT (JSON per table and the log). About 8 minutes on an H200 (the tables in order of
# importance: a run cut short by the timeout keeps the first ones).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/benchmarks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="$PWD/src:/tmp/site"
else
  export PYTHONPATH="$PWD/src"
fi
export PYTHONUNBUFFERED=1
{
  date -u +"start %Y-%m-%d %H:%M:%S UTC"
  echo "commit ${COMMIT:-unknown}"
  nvidia-smi -L
  python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.log"
# No host sync in the router's backward and step (fused AdamW, one GradScaler): set_sync_debug_mode("error")
for dtype in fp16 bf16; do
  timeout 60 python3 benchmarks/sync_check.py --dtype "$dtype" 2>&1 | tee -a "$OUT/gpu.log"
done
bench() {
  name=$1
  shift
  echo "== $name: $*" | tee -a "$OUT/gpu.log"
  timeout 200 python3 -m gradroute bench --workload sd15 --device cuda "$@" \
    --targets "$(awk '$1 == "bench" { print $2 }' benchmarks/targets)" --json "$OUT/$name.json" 2>&1 \
    | tee -a "$OUT/gpu.log"
}
# The whole training iteration (`bench --step`: two fused AdamW, clipping, schedulers; fp16 with one GradScaler),
# the router's loop against the hand-written one, ratios against benchmarks/targets. Both loops hold a copy of
# SD-1.5 with its AdamW state (about 16 GB each). `bash benchmarks/gpu.sh step` runs these alone (about 5
# minutes), `bash benchmarks/gpu.sh all` after the tables.
step() {
  name=$1 regime=$2
  shift 2
  echo "== $name: --step $*" | tee -a "$OUT/gpu.log"
  timeout 240 python3 -m gradroute bench --step --workload sd15 --device cuda "$@" \
    --targets "$(awk -v n="step-$regime" '$1 == n { print $2 }' benchmarks/targets)" --json "$OUT/$name.json" 2>&1 \
    | tee -a "$OUT/gpu.log"
}
if [ "${1:-tables}" != step ]; then
  # batch 32: GPU-bound (at batch 8 the min and median step differ by 25%: launch-bound)
  bench sd15-b32 --batch-size 32 --steps 8 --warmup 3
  bench sd15-b32-ckpt --batch-size 32 --steps 8 --warmup 3 --checkpointing
  bench sd15-b8 --batch-size 8 --steps 15 --warmup 3
  bench sd15-b8-ckpt --batch-size 8 --steps 15 --warmup 3 --checkpointing
  # launch-bound: the router's own host work shows; Router(static_graph=True) follows paths instead of walking
  bench sd15-b8-static --batch-size 8 --steps 15 --warmup 3 --static-graph
fi
if [ "${1:-tables}" != tables ]; then
  step sd15-step-b32-fp16 compute --batch-size 32 --steps 8 --warmup 3 --dtype fp16
  step sd15-step-b8-fp16 host --batch-size 8 --steps 15 --warmup 3 --dtype fp16
  step sd15-step-b8-bf16 host --batch-size 8 --steps 15 --warmup 3 --dtype bf16
fi
date -u +"end %Y-%m-%d %H:%M:%S UTC" | tee -a "$OUT/gpu.log"
