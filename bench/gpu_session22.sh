#!/usr/bin/env bash
# Session 22, second GPU call (under 230 s): the norm backwards with rstd and the table rows prefetched with dy and
# x (bench/knob_sweep.py --ops norm_bwd), qk_norm_rope's new backward prefetch by tile and program count
# (--ops qk_prefetch), then the norm tests on CUDA (both prefetches
# keep the bytes).
source bench/device_env.sh || exit 1
step sweeps 150 sweeps.log python3 bench/knob_sweep.py --ops norm_bwd,qk_prefetch --budget-s 130 --json $OUT/sweeps.json
step tests 120 gpu_tests.log python3 -m pytest -q tests/kernels/test_norm.py -n 4 -p no:cacheprovider
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -8
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
