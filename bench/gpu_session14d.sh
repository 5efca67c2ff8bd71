#!/usr/bin/env bash
# H200 session 14, call 4: are our attention kernels slower in the block because of the block's data? Time them and
# SDPA cuDNN on the block's captured q/k/v/dO and on randn of the same shape (bench/attention_inputs.py).
source bench/device_env.sh || exit 1
stamp inputs | tee -a $OUT/stamps.txt
timeout 240 python3 bench/attention_inputs.py > $OUT/attention_inputs.log 2>&1
echo "inputs rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -v "^USDT\|^STAGE" $OUT/attention_inputs.log | tail -14 | cut -c1-250
