#!/usr/bin/env bash
# Session 23, second GPU call (under 190 s): norm.py's finish kernel by step shape (FINISH_BLOCK_P partials per step
# over 4096 / P columns: fewer latency-bound steps, more programs), then gated_residual's backward tiles again with
# the column block first (session 23's first call timed three tiles within 0.005 ms of each other).
# Then bench/kernel_parts.py: the modulated norm's backward by launch group, next to the plain one.
source bench/device_env.sh || exit 1
step finish 60 finish.log python3 bench/knob_sweep.py --ops norm_finish --budget-s 45 --json $OUT/finish.json
settings=()
for tile in 8,512 16,256 32,256 16,512 8,1024 4,1024; do
  settings+=(--setting "residual.GATED_TILE_S=${tile%,*},residual.GATED_BLOCK_H=${tile#*,}")
done
step gated 60 gated.log python3 bench/knob_sweep.py --ops gated_residual --budget-s 45 --json $OUT/gated.json \
  "${settings[@]}"
step parts 40 parts.log python3 bench/kernel_parts.py
cat $OUT/parts.log
sed -n '/best first/,$p' $OUT/finish.log | cut -c1-170
sed -n '/best first/,$p' $OUT/gated.log | cut -c1-170
