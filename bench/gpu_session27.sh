#!/usr/bin/env bash
# Session 27's GPU call (under 450 s): the issue-4 suite on the current defaults (modulation.finish_segments at
# 256 x 16 since 3cb52ff, never suite-measured); then qk_norm_rope's forward variants against the row tiles (32 rows
# x 8 warps): one program per position (its cos/sin row loaded once for the 56 heads, QK_FWD_PER_POSITION=1) at 4 /
# 8 / 16 warps, and the partner lanes by tl.gather instead of a second load (QK_FWD_GATHER=1; ptxas sm_90 on the CPU:
# 102 registers against 64 in row tiles, 80 against 88 per position); then every CUDA test.
source bench/device_env.sh || exit 1
issue4_suite 150
q=qk_norm_rope
step qk_fwd 90 qk_fwd.log python3 bench/knob_sweep.py --ops qk_norm_rope --budget-s 75 --json $OUT/qk_fwd.json \
  --setting "" --setting $q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=16 \
  --setting $q.QK_FWD_GATHER=1 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1,$q.QK_FWD_WARPS=16
sed -n '/best first/,$p' $OUT/qk_fwd.log | cut -c1-170
cuda_tests 180
