#!/usr/bin/env bash
# Session 20, first GPU call (under 560 s; the card is the first line of stamps.txt): session 19c's never-run call
# (every CUDA test on the two-piece norms, then the issue-4 suite on the final defaults), then the norm backward sweep
# (one block or two pieces) on this card: the split backwards were timed only on an H100.
source bench/device_env.sh || exit 1
cuda_tests 280
step sweep 100 norm_bwd_sweep.log python3 bench/knob_sweep.py --ops norm_bwd --json $OUT/norm_bwd_sweep.json
sed -n '/best first/,$p' $OUT/norm_bwd_sweep.log | cut -c1-170
issue4_suite 170
