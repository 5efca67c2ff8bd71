#!/usr/bin/env bash
# Written in session 16 for one H200 call (under 580 s); that session was lent no device, so it has not run yet.
# It measures the two paths session 16 added, both off by default until it does:
#   - the fused dQ (AttnConfig.dq_fused: dQ's matmul inside the dK/dV kernel, int32 fixed-point atomics, a finish
#     kernel): the fused sweep at S=16384 (bench/attention_sweep_fused.txt), the real-width block with the
#     spill-free fused setting and with the table (H3KERNELS_ATTN_CONFIG), and the fixed point's error on randn and
#     on the block's captured q/k/v/dO (bench/fused_dq_error.py);
#   - the qk_norm_rope backward reading cos/sin once per row tile (qk_norm_rope.QK_BWD_ROPE_PER_TILE): the knob
#     sweep with and without it.
# The attention and norm tests run on CUDA first (the per-tile qk path is tested on the CPU only).
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
stamp qk | tee -a $OUT/stamps.txt
timeout 50 python3 bench/knob_sweep.py --ops qk_norm_rope --setting "" \
  --setting "qk_norm_rope.QK_BWD_ROPE_PER_TILE=1" > $OUT/qk_sweep.log 2>&1
echo "qk sweep rc $?" | tee -a $OUT/stamps.txt
stamp error | tee -a $OUT/stamps.txt
timeout 45 python3 bench/fused_dq_error.py > $OUT/fused_dq_error.log 2>&1
echo "fused_dq_error rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -E "^skip|Error|compiled" $OUT/sweep.log | cut -c1-200 | head -8
sed -n '/^S=16384, sorted/,$p' $OUT/sweep.log | cut -c1-190
for f in $OUT/block-*.log; do echo "== $(basename $f)"; grep -E "^block S=" "$f" | cut -c1-150; done
sed -n '/best first/,$p' $OUT/qk_sweep.log | cut -c1-170
cat $OUT/fused_dq_error.log | tail -3
