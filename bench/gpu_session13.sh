#!/usr/bin/env bash
# H200 session 13: after the index range check stopped syncing the device on every call (h3kernels/_common.py
# index_range) and adaln_table's GEMV kernels accumulate elementwise: the no-sync test and the modulation tests on
# CUDA, the block profile again (device idle per pass), the adaln tile sweep, and bench/block.py's forward+backward
# times at S=4096 and 16384, the issue-4 target.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 120 python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_modulation.py -p no:cacheprovider \
  > $OUT/norm_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR" $OUT/norm_tests.log | cut -c1-300 | tail -6
stamp profile | tee -a $OUT/stamps.txt
timeout 130 python3 bench/block_profile.py --top 30 > $OUT/block_profile.log 2>&1
echo "profile rc $?" | tee -a $OUT/stamps.txt
stamp adaln | tee -a $OUT/stamps.txt
timeout 90 python3 bench/adaln_tiles.py > $OUT/adaln_tiles.log 2>&1
echo "adaln rc $?" | tee -a $OUT/stamps.txt
stamp block | tee -a $OUT/stamps.txt
timeout 180 python3 bench/block.py --seqlens 4096 16384 --json $OUT/block.json > $OUT/block.log 2>&1
echo "block rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -v "^USDT\|^STAGE" $OUT/block_profile.log | grep -E "^(category|pass)" | cut -c1-200
tail -11 $OUT/adaln_tiles.log
tail -22 $OUT/block.log | cut -c1-200
