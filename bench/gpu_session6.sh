#!/usr/bin/env bash
# H200 session 6: the `block` reference (FP32, FP32-alt, three BF16 providers), its calibration and the gate
# (h3gate qualify), then the gate's candidate run vs a bare candidate forward+backward (bench/gate_overhead.py).
source bench/device_env.sh || exit 1
stamp qualify; /usr/bin/time -f "qualify wall %e s" timeout 450 python3 -m flows.cli qualify --preset block \
  --device cuda --store /tmp/st --providers default,flash,cudnn 2>&1 | tee $OUT/qualify_block.log \
  | grep -vE "INFO|Warning" | tail -8
stamp runs; python3 bench/reference_runs.py /tmp/st block | tee $OUT/block_runs.txt
df -h /tmp | tail -1
stamp overhead; timeout 120 python3 bench/gate_overhead.py /tmp/st --preset block --reps 3 2>&1 \
  | tee $OUT/gate_overhead_block.log | tail -7
stamp done
