#!/usr/bin/env bash
# H200 session 14, call 3: with the new attention table (TMA forward at 128-key steps, TMA dQ) and the 4-warp adaln
# GEMV: the attention GPU tests, then the issue-4 suite in one run (bench/kernel_suite.py: fused kernels against the
# measured copy bandwidth, attention against SDPA at S=4096/16384/32768, the real-width block vs the default).
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 100 python3 -m pytest -q tests/kernels/test_attention.py -m gpu -p no:cacheprovider > $OUT/attention_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/attention_tests.log | cut -c1-300 | tail -8
stamp suite | tee -a $OUT/stamps.txt
timeout 420 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -v "^USDT\|^STAGE" $OUT/kernels.log | tail -60 | cut -c1-200
