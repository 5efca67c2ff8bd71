#!/usr/bin/env bash
# Session 22, third GPU call (under 200 s): on the new defaults (both norm backwards and qk_norm_rope's backward
# prefetching, 792 qk programs), qk's backward with cos/sin read once per tile (fewer registers: 136 against 161, so
# seven programs per SM) or per row, by program count; then the issue-4 suite.
source bench/device_env.sh || exit 1
settings=()
for per_tile in 0 1; do for programs in 660 792 924 1056; do
  settings+=(--setting "qk_norm_rope.QK_BWD_ROPE_PER_TILE=$per_tile,qk_norm_rope.QK_BWD_PROGRAMS=$programs")
done; done
step sweeps 60 sweeps.log python3 bench/knob_sweep.py --ops qk_norm_rope --budget-s 45 --json $OUT/sweeps.json \
  "${settings[@]}"
issue4_suite 130
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
