#!/usr/bin/env bash
# H200 session 16, call 1 (under 580 s): the fused dQ (AttnConfig.dq_fused: dQ's matmul inside the dK/dV kernel,
# int32 fixed-point atomics, a finish kernel) and the qk_norm_rope backward reading cos/sin once per tile. The
# attention and norm tests on CUDA, the fused sweep at S=16384 (bench/attention_sweep_fused.txt), the real-width
# block with two fused settings and with the table, and the fused-kernel table.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 100 python3 -m pytest -q tests/kernels/test_attention.py tests/kernels/test_norm.py -p no:cacheprovider \
  > $OUT/kernel_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/kernel_tests.log | cut -c1-300 | tail -6
stamp sweep | tee -a $OUT/stamps.txt
timeout 160 python3 bench/attention.py --sweep bench/attention_sweep_fused.txt --budget-s 100 > $OUT/sweep.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
block() {
  stamp "block [$1]" | tee -a $OUT/stamps.txt
  H3KERNELS_ATTN_CONFIG="$1" timeout 90 python3 bench/block.py --seqlens 16384 4096 > "$OUT/block-${1:-table}.log" 2>&1
  echo "block rc $?" | tee -a $OUT/stamps.txt
}
block "dq_fused=1,dkdv_m=16"
block ""
stamp kernels | tee -a $OUT/stamps.txt
timeout 50 python3 bench/kernel_suite.py --skip-attention --skip-block > $OUT/kernels.log 2>&1
echo "kernels rc $?" | tee -a $OUT/stamps.txt
block "dq_fused=1"
stamp done | tee -a $OUT/stamps.txt
grep -E "^skip|Error|compiled" $OUT/sweep.log | cut -c1-200 | head -8
sed -n '/^S=16384, sorted/,$p' $OUT/sweep.log | cut -c1-190
for f in $OUT/block-*.log; do echo "== $(basename $f)"; grep -E "^block S=" "$f" | cut -c1-150; done
grep "^kernel " $OUT/kernels.log | cut -c1-120
