#!/usr/bin/env bash
# H200 session 11 (the last ~420 s of the day's device time): every kernel test and the GPU-marked tests on
# CUDA, compiled rather than interpreted (session 8's 70 s step stopped after 84 of them).
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 360 python3 -m pytest -q tests/kernels tests/test_compare.py -p no:cacheprovider --durations=8 \
  > $OUT/gpu_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -15
stamp done | tee -a $OUT/stamps.txt
