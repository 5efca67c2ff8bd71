#!/usr/bin/env bash
# Session 19, second GPU call (under 250 s; the card is the first line of stamps.txt):
#   - tests/kernels/test_norm.py on CUDA, with the backwards' two-piece rows (MODULATE/RMS_NORM_BWD_SPLIT) and
#     qk_norm_rope's three-piece heads (rotary halves without the partner-lane gather);
#   - the norm backwards: one block or 4096 + 2048 pieces, with and without the prefetch, at 8 / 16 warps;
#   - qk_norm_rope on the three pieces: the defaults and nearby tiles (registers changed: bench/RESULTS.md).
# It ran on an H100 (bench/results/h100-session19b-*): the split backwards won at 8 warps and stayed; the
# three-piece qk_norm_rope lost (scalar loads) and was reverted, so its sweep lines now time the partner-gather kernel.
source bench/device_env.sh || exit 1
step tests 150 norm_tests.log python3 -m pytest -q tests/kernels/test_norm.py -n 4 -p no:cacheprovider
grep -E "passed|failed|FAILED|ERROR" $OUT/norm_tests.log | cut -c1-300 | tail -8
step sweep 150 norm_bwd_sweep.log python3 bench/knob_sweep.py --ops norm_bwd --json $OUT/norm_bwd_sweep.json
q=qk_norm_rope
step qk 120 qk_sweep.log python3 bench/knob_sweep.py --ops qk_norm_rope --setting "" \
  --setting "$q.QK_FWD_ROWS=16,$q.QK_FWD_WARPS=4" --setting "$q.QK_FWD_ROWS=64,$q.QK_FWD_WARPS=8" \
  --setting "$q.QK_BWD_ROWS=16,$q.QK_BWD_WARPS=4" --setting "$q.QK_BWD_ROWS=4,$q.QK_BWD_WARPS=1" \
  --setting "$q.QK_BWD_ROPE_PER_TILE=1" --json $OUT/qk_sweep.json
stamp done | tee -a $OUT/stamps.txt
sed -n '/best first/,$p' $OUT/norm_bwd_sweep.log | cut -c1-190
sed -n '/best first/,$p' $OUT/qk_sweep.log | cut -c1-190
