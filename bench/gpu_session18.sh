#!/usr/bin/env bash
# Session 18, one GPU call (under 580 s; the card it ran on is the first line of stamps.txt): a verdict of every
# CUDA test (tests/kernels and tests/test_compare.py, four xdist workers sharing the GPU, so that Triton's compiles
# overlap: session 17's serial run hit its 100 s limit), then the whole issue-4 suite on main's defaults.
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a $OUT/stamps.txt
stamp tests | tee -a $OUT/stamps.txt
timeout 330 python3 -m pytest -q tests/kernels tests/test_compare.py -n 4 -p no:cacheprovider --durations=15 \
  > $OUT/gpu_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -12
stamp suite | tee -a $OUT/stamps.txt
timeout 170 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -E "^(kernels|attention|block) " $OUT/kernels.log | cut -c1-200
