#!/usr/bin/env bash
# H200 session 15, call 5 (under 400 s): the final defaults (gated_residual backward 16 x 256 at 4 warps, spill-free,
# picked from call 4's sweep; qk_norm_rope backward 8 rows x 2 warps). The kernel and binding tests on CUDA, then
# the whole suite (its table: bench/results/h200-session15e-kernels.log).
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 200 python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_residual.py \
  tests/kernels/test_segments.py tests/kernels/test_binding.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/kernel_tests.log | cut -c1-300 | tail -6
stamp suite | tee -a $OUT/stamps.txt
timeout 170 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -E "^(kernels|attention|block) " $OUT/kernels.log | cut -c1-200
