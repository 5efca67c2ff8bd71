#!/usr/bin/env bash
# H200 session 14, call 2: the TMA sweep's gains were within run-to-run noise except dQ (16.5 vs 17.2 ms in two
# lines) and the 128x128 forward; time those against the table with 40 iterations, then the block's
# forward+backward at S=16384 with the table and with both (H3KERNELS_ATTN_CONFIG), and the block profile of the
# latter (in-block attention kernel times).
source bench/device_env.sh || exit 1
best="fwd_tma=1,fwd_n=128,dq_tma=1"
stamp attention | tee -a $OUT/stamps.txt
timeout 150 python3 bench/attention.py --seqlens 16384 --iters 40 --config fwd_m=128 --config dq_tma=1 \
  --config fwd_tma=1,fwd_n=128 --config "$best" > $OUT/attention_confirm.log 2>&1
echo "attention rc $?" | tee -a $OUT/stamps.txt
stamp block-table | tee -a $OUT/stamps.txt
timeout 150 python3 bench/block.py --seqlens 16384 --json $OUT/block_table.json > $OUT/block_table.log 2>&1
echo "block rc $?" | tee -a $OUT/stamps.txt
stamp block-tma | tee -a $OUT/stamps.txt
H3KERNELS_ATTN_CONFIG="$best" timeout 150 python3 bench/block.py --seqlens 16384 --json $OUT/block_tma.json \
  > $OUT/block_tma.log 2>&1
echo "block rc $?" | tee -a $OUT/stamps.txt
stamp profile | tee -a $OUT/stamps.txt
H3KERNELS_ATTN_CONFIG="$best" timeout 120 python3 bench/block_profile.py --top 12 > $OUT/block_profile_tma.log 2>&1
echo "profile rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
tail -8 $OUT/attention_confirm.log | cut -c1-200
tail -12 $OUT/block_table.log | cut -c1-200
tail -12 $OUT/block_tma.log | cut -c1-200
grep -v "^USDT\|^STAGE" $OUT/block_profile_tma.log | grep -E "^(category|pass|attention|sdpa|h3)" | cut -c1-200
