#!/usr/bin/env bash
# Session 27's first GPU call (under 510 s): the issue-4 suite on the current defaults (modulation.finish_segments at
# 256 x 16 since 3cb52ff, never suite-measured); then the variants prepared in session 27 against the defaults
# (bench/RESULTS.md, session 27, lists their registers):
# - qk_norm_rope forward: one program per position (QK_FWD_PER_POSITION=1) at 4 / 8 / 16 warps; partner lanes by
#   tl.gather (QK_FWD_GATHER=1).
# - qk_norm_rope backward: dy[p] sin[p] by tl.gather (QK_BWD_GATHER=1; five programs per SM, not six, so also at
#   660 = 5 x 132); loads pipelined through shared memory (QK_BWD_PREFETCH=0, QK_BWD_STAGES 2-4; also at 924 = 7 x 132).
# - norm finish: a block's six table rows in one step (FINISH_BLOCK_R=8) at 4 and 8 warps.
# - norm backwards: the runs kernel (NORM_BWD_RUNS=1), loads pipelined 2 / 3 / 4 stages deep.
# - gated_residual backward: its one-table-row chunks' loads pipelined (GATED_STAGES 2 / 3 / 4).
# Every CUDA test: gpu_session27b.sh, straight after.
source bench/device_env.sh || exit 1
issue4_suite 150
q=qk_norm_rope
step qk 150 qk.log python3 bench/knob_sweep.py --ops qk_norm_rope --budget-s 130 --json $OUT/qk.json \
  --setting "" --setting $q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=4 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_WARPS=16 \
  --setting $q.QK_FWD_GATHER=1 --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1 \
  --setting $q.QK_FWD_PER_POSITION=1,$q.QK_FWD_GATHER=1,$q.QK_FWD_WARPS=16 \
  --setting $q.QK_BWD_GATHER=1 --setting $q.QK_BWD_GATHER=1,$q.QK_BWD_PROGRAMS=660 \
  --setting $q.QK_BWD_GATHER=1,$q.QK_BWD_PROGRAMS=528 --setting $q.QK_BWD_PROGRAMS=660 \
  --setting $q.QK_BWD_PREFETCH=0,$q.QK_BWD_STAGES=2 --setting $q.QK_BWD_PREFETCH=0,$q.QK_BWD_STAGES=3 \
  --setting $q.QK_BWD_PREFETCH=0,$q.QK_BWD_STAGES=4 \
  --setting $q.QK_BWD_PREFETCH=0,$q.QK_BWD_STAGES=3,$q.QK_BWD_PROGRAMS=924
sed -n '/best first/,$p' $OUT/qk.log | cut -c1-170
n=norm
step norm_finish 75 norm_finish.log python3 bench/knob_sweep.py --ops norm_finish --budget-s 60 \
  --json $OUT/norm_finish.json --setting "" --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=2 \
  --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4 \
  --setting $n.FINISH_BLOCK_P=128,$n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4 \
  --setting $n.FINISH_BLOCK_P=128,$n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=8 \
  --setting $n.FINISH_BLOCK_R=8,$n.FINISH_BLOCK_H=4,$n.FINISH_WARPS=8
sed -n '/best first/,$p' $OUT/norm_finish.log | cut -c1-170
step norm_runs 60 norm_runs.log python3 bench/knob_sweep.py --ops norm_runs --budget-s 45 --json $OUT/norm_runs.json
sed -n '/best first/,$p' $OUT/norm_runs.log | cut -c1-170
step gated 45 gated.log python3 bench/knob_sweep.py --ops gated_residual --budget-s 35 --json $OUT/gated.json \
  --setting "" --setting residual.GATED_STAGES=2 --setting residual.GATED_STAGES=3 --setting residual.GATED_STAGES=4
sed -n '/best first/,$p' $OUT/gated.log | cut -c1-170
