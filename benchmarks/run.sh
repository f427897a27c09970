#!/usr/bin/env bash
# Re-runs the CPU measurements behind BENCHMARKS.md; raw results go to build/benchmarks/ (*.json, *.png, *.txt).
# A figure that goes into BENCHMARKS.md becomes a record in benchmarks/results/ (see benchmarks/render.py).
# CPU tables: run on a quiet machine (the strategies are interleaved step by step, but two OpenMP threads
# fighting other jobs make medians unusable). GPU tables (sd15): a CUDA machine with diffusers+transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=build/benchmarks
mkdir -p "$out"
# the bounds on the printed ratios: benchmarks/targets
target() { awk -v n="$1" '$1 == n { print $2 }' benchmarks/targets; }
bench() {
  name=$1
  shift
  "$PY" -m gradroute bench "$@" --targets "$(target bench)" --json "$out/$name.json" --plot "$out/$name.png"
}

bench sd-tiny          --workload sd-tiny --steps 20 --warmup 3
bench sd-tiny-ckpt     --workload sd-tiny --checkpointing --steps 20 --warmup 3
# host-bound: tiny tensors, per-op and per-engine-call host work dominates (a GPU at a fine-tuning batch is too)
bench sd-tiny-host      --workload sd-tiny --width 8 --batch-size 1 --threads 1 --steps 30 --warmup 3
bench sd-tiny-host-ckpt --workload sd-tiny --width 8 --batch-size 1 --threads 1 --steps 30 --warmup 3 --checkpointing
bench sd-tiny-host-static --workload sd-tiny --width 8 --batch-size 1 --threads 1 --steps 30 --warmup 3 --static-graph
# the same steps in CPU time (robust to other processes), every gradroute strategy with and without static_graph
# (medians over processes: one process's ratios carry a bias of their own, see the script)
PYTHONPATH=src "$PY" benchmarks/host_step.py --processes 10 > "$out/host-step.txt"
PYTHONPATH=src "$PY" benchmarks/host_step.py --checkpointing --steps 40 --processes 6 > "$out/host-step-ckpt.txt"
# and the compute-bound regime (the bench's default sd-tiny size) in CPU time, one thread
PYTHONPATH=src "$PY" benchmarks/host_step.py --width 32 --batch-size 16 --steps 20 --warmup 3 > "$out/compute-step.txt"
PYTHONPATH=src "$PY" benchmarks/host_step.py --width 32 --batch-size 16 --steps 20 --warmup 3 --checkpointing \
  > "$out/compute-step-ckpt.txt"
# how often the measured plan choice keeps the fastest candidate (median or minimum of its 3 trials), host-bound
PYTHONPATH=src "$PY" benchmarks/choice_noise.py --repeats 60 > "$out/choice-noise.txt"
PYTHONPATH=src "$PY" benchmarks/choice_noise.py --checkpointing --repeats 20 >> "$out/choice-noise.txt"
# where the host time of a routed backward goes there (CPU time per part, cProfile, counts)
for a in "" "--checkpointing" "--checkpointing --no-autotune" "--checkpointing --kind torch"; do
  PYTHONPATH=src "$PY" benchmarks/profile_host.py $a --steps 30
done > "$out/profile-host.txt"
# SD-1.5 with cut points on the meta device: the routed backward's host time against the summed one's, and
# the nodes the engine's per-call dependency pass visits for three plans (counts); the sd15 workload needs
# diffusers and transformers
if "$PY" -c "import diffusers, transformers" 2>/dev/null; then
  PYTHONPATH=src "$PY" benchmarks/meta_host_time.py > "$out/meta-host-time.txt"
  PYTHONPATH=src "$PY" benchmarks/engine_reach.py > "$out/engine-reach.txt"
  # the floor of an exact route there: the hand-written cut against the summed backward (no checkpointing)
  PYTHONPATH=src "$PY" benchmarks/meta_floor.py > "$out/meta-floor.txt"
  # with checkpointing: the hand cut and the sum with torch's checkpoint, the routers with cut points
  PYTHONPATH=src "$PY" benchmarks/meta_floor.py --checkpointing cuts > "$out/meta-floor-cuts.txt"
  # the whole training iteration with AdamW state at SD-1.5 scale, traced: its peak against the hand-written loop's
  for a in "--no-checkpointing" "--kind gradroute,cuts"; do
    PYTHONPATH=src "$PY" benchmarks/trace_memory.py --workload sd15 --device meta --batch-size 8 --iteration $a \
      --targets "$(awk '$1 == "trace-iteration" { print $2 }' benchmarks/targets)"
  done > "$out/trace-iteration.txt"
fi
bench gan              --workload gan --threads 1 --steps 20 --warmup 3
# the whole training iteration (forward, routed backward, two fused AdamW, clipping, schedulers, zero_grad) of
# the router's loop against torch's AMP recipe after the hand cut, interleaved; time and the whole iteration's
# peak (the next forward included), ratios printed against benchmarks/targets
step() {
  name=$1 regime=$2
  shift 2
  "$PY" -m gradroute bench --step "$@" --targets "$(target "step-$regime")" --json "$out/$name.json" | tee "$out/$name.txt"
}
step step-sd-tiny      compute --workload sd-tiny --steps 20 --warmup 3
step step-sd-tiny-host host    --workload sd-tiny --width 8 --batch-size 1 --threads 1 --steps 30 --warmup 3
step step-gan          compute --workload gan --threads 1 --steps 20 --warmup 3
step step-gan-host     host    --workload gan --width 8 --batch-size 1 --threads 1 --steps 30 --warmup 3
# the same iterations' peaks traced tensor by tensor (live bytes, no allocator or Python heap in them)
for a in "sd-tiny --no-checkpointing" "sd-tiny --width 8 --batch-size 1 --no-checkpointing" "gan" \
  "gan --width 8 --batch-size 1"; do
  echo "== $a"
  PYTHONPATH=src "$PY" benchmarks/trace_memory.py --iteration --workload $a --targets "$(target trace-iteration)"
done > "$out/trace-iteration-cpu.txt"
bench actor-critic     --workload actor-critic --steps 50 --warmup 3
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  bench sd15-b8        --workload sd15 --batch-size 8 --steps 15 --warmup 3
  bench sd15-b16       --workload sd15 --batch-size 16 --steps 10 --warmup 3
  bench sd15-b32       --workload sd15 --batch-size 32 --steps 8 --warmup 3
  bench sd15-b32-ckpt  --workload sd15 --batch-size 32 --steps 8 --warmup 3 --checkpointing
fi
