#!/usr/bin/env bash
# Session 19, first GPU call (under 300 s; the card is the first line of stamps.txt):
#   - tests/kernels/test_norm.py on CUDA, with the forward's new two-piece rows  and both settings;
#   - the norm forwards: one block of 8192 lanes or 4096 + 2048 pieces, at 4 / 8 / 16 warps (bench/knob_sweep.py);
#   - the whole issue-4 suite on main's defaults (session 18c's call, never run).
# It ran on an H200 (bench/results/h200-session19-*) with one NORM_FWD_SPLIT for both norms, on by default; the
# result split it into MODULATE_FWD_SPLIT (on) and RMS_NORM_FWD_SPLIT (off), the names the sweep now sets.
source bench/device_env.sh || exit 1
step tests 150 norm_tests.log python3 -m pytest -q tests/kernels/test_norm.py -n 4 -p no:cacheprovider
grep -E "passed|failed|FAILED|ERROR" $OUT/norm_tests.log | cut -c1-300 | tail -8
step sweep 150 norm_fwd_sweep.log python3 bench/knob_sweep.py --ops norm_fwd --json $OUT/norm_fwd_sweep.json
step suite 180 kernels.log python3 bench/kernel_suite.py --json $OUT/kernels.json
stamp done | tee -a $OUT/stamps.txt
sed -n '/best first/,$p' $OUT/norm_fwd_sweep.log | cut -c1-170
grep -E "^(kernels|block) " $OUT/kernels.log | grep -v "rel-L2" | cut -c1-200
