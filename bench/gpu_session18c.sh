#!/usr/bin/env bash
# Session 18, third GPU call (under 250 s): the norm tests on CUDA with RMS_NORM_BWD_PREFETCH=1 (the new default),
# then the whole issue-4 suite on those defaults. Not run in session 18: the refused starts spent its device time.
# What it would confirm was measured piecewise in 18b (both prefetch paths on CUDA: tests and the norm sweep).
source bench/device_env.sh || exit 1
step tests 100 norm_tests.log python3 -m pytest -q tests/kernels/test_norm.py -n 4 -p no:cacheprovider
grep -E "passed|failed|FAILED|ERROR" $OUT/norm_tests.log | cut -c1-300 | tail -8
step suite 130 kernels.log python3 bench/kernel_suite.py --json $OUT/kernels.json
stamp done | tee -a $OUT/stamps.txt
grep -E "^(kernels|block) " $OUT/kernels.log | grep -v "rel-L2" | cut -c1-200
