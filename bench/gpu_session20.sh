#!/usr/bin/env bash
# Session 20, first GPU call (under 590 s; the card is the first line of stamps.txt): session 19c's never-run call
# (every CUDA test on the two-piece norms and the gated backward's prefetch, then the issue-4 suite on the final
# defaults), and two sweeps on this card: the norm backwards (one block or two pieces; timed only on an H100 so far)
# and the gated backward's prefetch by tile and warps; also the JIT's registers per kernel (bench/kernel_regs.py).
source bench/device_env.sh || exit 1
cuda_tests 260
step regs 60 kernel_regs.log python3 bench/kernel_regs.py
cat $OUT/kernel_regs.log | cut -c1-100
step sweeps 110 sweeps.log python3 bench/knob_sweep.py --ops norm_bwd,gated_prefetch --budget-s 90 \
  --json $OUT/sweeps.json
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
issue4_suite 170
