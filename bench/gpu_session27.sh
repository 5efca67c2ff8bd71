#!/usr/bin/env bash
# Session 27's first GPU call (under 450 s): the issue-4 suite on the current defaults (modulation.finish_segments at
# 256 x 16 since 3cb52ff, never suite-measured); then qk_norm_rope's variants against the defaults. Forward (row tiles
# of 32 rows x 8 warps): one program per position (its cos/sin row loaded once for the 56 heads,
# QK_FWD_PER_POSITION=1) at 4 / 8 / 16 warps, and the partner lanes by tl.gather instead of a second load
# (QK_FWD_GATHER=1; ptxas sm_90 on the CPU: 102 registers against 64 in row tiles, 80 against 88 per position).
# Backward: dy[p] sin[p] by tl.gather (QK_BWD_GATHER=1: 188 registers against 161, five programs per SM, not six, so
# also at 660 = 5 x 132 programs). Then norm.py's finish with a block's six table rows in one step (FINISH_BLOCK_R=8;
# at 4 and 8 warps) against one row a step, which also writes d_table's zero chunks now (no zeros_like launch). Every
# CUDA test: gpu_session27b.sh.
source bench/device_env.sh || exit 1
issue4_suite 150
q=qk_norm_rope
step qk 120 qk.log python3 bench/knob_sweep.py --ops qk_norm_rope --budget-s 100 --json $OUT/qk.json \
  --setting "" --setting $q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=16 \
  --setting $q.QK_FWD_GATHER=1 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1,$q.QK_FWD_WARPS=16 \
  --setting $q.QK_BWD_GATHER=1 --setting $q.QK_BWD_GATHER=1,$q.QK_BWD_PROGRAMS=660 \
  --setting $q.QK_BWD_GATHER=1,$q.QK_BWD_PROGRAMS=528 --setting $q.QK_BWD_PROGRAMS=660
sed -n '/best first/,$p' $OUT/qk.log | cut -c1-170
n=norm
step norm_finish 75 norm_finish.log python3 bench/knob_sweep.py --ops norm_finish --budget-s 60 \
  --json $OUT/norm_finish.json --setting "" --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=2 \
  --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4 \
  --setting $n.FINISH_BLOCK_P=128,$n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4 \
  --setting $n.FINISH_BLOCK_P=128,$n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=8 \
  --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4,$n.FINISH_WARPS=8
sed -n '/best first/,$p' $OUT/norm_finish.log | cut -c1-170
# The norm backwards' runs kernel (NORM_BWD_RUNS=1: the tile loop pipelined 2 / 3 / 4 stages deep through shared
# memory instead of the register prefetch; 188 registers against 244 for the modulated norm at 3 stages).
step norm_runs 60 norm_runs.log python3 bench/knob_sweep.py --ops norm_runs --budget-s 45 --json $OUT/norm_runs.json
sed -n '/best first/,$p' $OUT/norm_runs.log | cut -c1-170
