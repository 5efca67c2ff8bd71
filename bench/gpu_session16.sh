#!/usr/bin/env bash
# H200 session 16, call 1 (under 560 s): the fused dQ (AttnConfig.dq_fused: dQ's matmul inside the dK/dV kernel,
# int32 fixed-point atomics, a finish kernel). The attention tests on CUDA, the fused sweep at S=16384
# (bench/attention_sweep_fused.txt), then the real-width block with the table and with two fused settings.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 90 python3 -m pytest -q tests/kernels/test_attention.py -p no:cacheprovider > $OUT/attention_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/attention_tests.log | cut -c1-300 | tail -6
stamp sweep | tee -a $OUT/stamps.txt
timeout 170 python3 bench/attention.py --sweep bench/attention_sweep_fused.txt --budget-s 110 > $OUT/sweep.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
for cfg in "" "dq_fused=1,dkdv_m=16" "dq_fused=1"; do
  stamp "block [$cfg]" | tee -a $OUT/stamps.txt
  H3KERNELS_ATTN_CONFIG="$cfg" timeout 100 python3 bench/block.py --seqlens 16384 4096 > "$OUT/block-${cfg:-table}.log" 2>&1
  echo "block rc $?" | tee -a $OUT/stamps.txt
done
stamp done | tee -a $OUT/stamps.txt
grep -E "^skip|Error|compiled" $OUT/sweep.log | cut -c1-200 | head -8
sed -n '/^S=16384, sorted/,$p' $OUT/sweep.log | cut -c1-190
for cfg in table "dq_fused=1,dkdv_m=16" "dq_fused=1"; do echo "== block [$cfg]"; grep -E "^block S=" "$OUT/block-$cfg.log" | cut -c1-150; done
