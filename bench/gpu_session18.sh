#!/usr/bin/env bash
# Session 18, one GPU call (under 580 s; the card it ran on is the first line of stamps.txt): a verdict of every
# CUDA test (tests/kernels and tests/test_compare.py, four xdist workers sharing the GPU, so that Triton's compiles
# overlap: session 17's serial run hit its 100 s limit), then the whole issue-4 suite on main's defaults.
source bench/device_env.sh || exit 1
step tests 330 gpu_tests.log python3 -m pytest -q tests/kernels tests/test_compare.py -n 4 -p no:cacheprovider \
  --durations=15
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -12
step suite 170 kernels.log python3 bench/kernel_suite.py --json $OUT/kernels.json
stamp done | tee -a $OUT/stamps.txt
grep -E "^(kernels|attention|block) " $OUT/kernels.log | cut -c1-200
