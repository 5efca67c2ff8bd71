#!/usr/bin/env bash
# H200 session 14, call 1 (under 600 s): TMA descriptor loads for the attention kernels' streamed tiles
# (AttnConfig fwd_tma / dkdv_tma / dq_tma). The attention tests on CUDA (TMA bytes == pointer bytes at the real
# width), then the TMA sweep at S=16384 (bench/attention_sweep_tma.txt), whose winner call 2 times in the block.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 150 python3 -m pytest -q tests/kernels/test_attention.py -m gpu -p no:cacheprovider --durations=4 \
  > $OUT/attention_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/attention_tests.log | cut -c1-300 | tail -8
stamp sweep | tee -a $OUT/stamps.txt
timeout 300 python3 bench/attention.py --sweep bench/attention_sweep_tma.txt --budget-s 220 --winner-seqlens 4096 \
  > $OUT/sweep_tma.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep "^skip" $OUT/sweep_tma.log | cut -c1-300
tail -20 $OUT/sweep_tma.log | cut -c1-230
