#!/usr/bin/env bash
# H200 session 8 (the last ~340 s of the day's device time): the segmented-sum fast paths. Where the modulated-
# norm and gated-residual backwards spend their time (bench/kernel_parts.py), the fused-kernel table and the
# real-width block (bench/kernel_suite.py), then the segment/norm/residual/modulation kernel tests on CUDA.
source bench/device_env.sh || exit 1
stamp parts; timeout 60 python3 bench/kernel_parts.py > $OUT/kernel_parts.log 2>&1; tail -7 $OUT/kernel_parts.log
stamp kernels; timeout 90 python3 bench/kernel_suite.py --skip-attention --json $OUT/kernels.json > $OUT/kernels.log 2>&1
grep -E "^kernel|^block|GB/s" $OUT/kernels.log | cut -c1-150 | tail -14
stamp tests; timeout 70 python3 -m pytest -q tests/kernels/test_segments.py tests/kernels/test_norm.py \
  tests/kernels/test_residual.py tests/kernels/test_modulation.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
stamp done
