#!/usr/bin/env bash
# H200 session 12 (one call, under 600 s): the binding tests session 11 failed, after their fixes; where the block's
# forward+backward time goes, kernel by kernel, default vs candidate (bench/block_profile.py); then the forward
# tile sweep (bench/attention_sweep_fwd.txt), whose best forward is combined with the table's backward.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 170 python3 -m pytest -q tests/kernels/test_binding.py -p no:cacheprovider --durations=5 \
  > $OUT/binding_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|adaln_proj weight" $OUT/binding_tests.log | cut -c1-300 | tail -8
stamp profile | tee -a $OUT/stamps.txt
timeout 130 python3 bench/block_profile.py --top 24 > $OUT/block_profile.log 2>&1
echo "profile rc $?" | tee -a $OUT/stamps.txt
stamp sweep | tee -a $OUT/stamps.txt
timeout 230 python3 bench/attention.py --sweep bench/attention_sweep_fwd.txt --budget-s 170 --winner-seqlens 4096 \
  > $OUT/sweep_fwd.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
tail -16 $OUT/sweep_fwd.log | cut -c1-230
grep -v "^USDT\|^STAGE" $OUT/block_profile.log | tail -34 | cut -c1-200
