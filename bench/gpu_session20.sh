#!/usr/bin/env bash
# Session 20, first GPU call (under 450 s; the card is the first line of stamps.txt): the registers the JIT gave each
# row-wise kernel (bench/kernel_regs.py); three sweeps: the norm backwards (one block or two pieces; timed only on
# an H100 so far), the gated backward's prefetch by tile rows and warps, the adaln GEMVs' pipeline stages; then the
# issue-4 suite on main's defaults. The second call (gpu_session20b.sh) runs every CUDA test.
source bench/device_env.sh || exit 1
step regs 60 kernel_regs.log python3 bench/kernel_regs.py
step sweeps 170 sweeps.log python3 bench/knob_sweep.py --ops norm_bwd,gated_prefetch,adaln_stages --budget-s 150 \
  --json $OUT/sweeps.json
issue4_suite 170
cut -c1-100 $OUT/kernel_regs.log
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
