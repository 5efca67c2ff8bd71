#!/usr/bin/env bash
# Session 19, third GPU call (under 400 s; the card is the first line of stamps.txt): a verdict of every CUDA test
# (tests/kernels and tests/test_compare.py, four xdist workers) on the two-piece norm kernels, then the whole
# issue-4 suite on the final defaults. Not run in session 19: every start after 19b was refused.
source bench/device_env.sh || exit 1
step tests 300 gpu_tests.log python3 -m pytest -q tests/kernels tests/test_compare.py -n 4 -p no:cacheprovider \
  --durations=10
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -12
step suite 170 kernels.log python3 bench/kernel_suite.py --json $OUT/kernels.json
stamp done | tee -a $OUT/stamps.txt
grep -E "^(kernels|attention|block) " $OUT/kernels.log | grep -v "rel-L2 vs fp32 d[Wh ]" | cut -c1-200
