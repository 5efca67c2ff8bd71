#!/usr/bin/env bash
# H200 session 15, call 3 (under 400 s): the defaults picked from call 2's sweep (qk_norm_rope backward 8 rows at
# 2 warps, spill-free; gated_residual backward 16 x 512 at 4 warps, 64 chunks). Their tests on CUDA; a confirm of the
# sweep's leaders against the old defaults, each setting twice, interleaved; the kernels section with and without
# the 4 GiB copy before it (call 2's suite timed the norm backwards 0.40/0.30 ms, its sweep 0.28/0.23 at the same
# constants); then the whole suite (attention, the block at S=4096/16384) with the new defaults.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 120 python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_residual.py \
  tests/kernels/test_segments.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/kernel_tests.log | cut -c1-300 | tail -6
stamp confirm | tee -a $OUT/stamps.txt
q=qk_norm_rope; r=residual
old_q="$q.QK_BWD_ROWS=32,$q.QK_BWD_WARPS=8"; q32="$q.QK_BWD_ROWS=32,$q.QK_BWD_WARPS=2"
old_g="$r.GATED_TILE_S=16,$r.GATED_BLOCK_H=256,$r.GATED_WARPS=8,$r.GATED_CHUNKS=64"
g2="$r.GATED_TILE_S=8,$r.GATED_BLOCK_H=1024,$r.GATED_WARPS=4,$r.GATED_CHUNKS=128"
g3="$r.GATED_TILE_S=8,$r.GATED_BLOCK_H=256,$r.GATED_WARPS=4,$r.GATED_CHUNKS=128"
timeout 100 python3 bench/knob_sweep.py --ops qk_norm_rope,gated_residual --setting "" --setting "$old_q,$old_g" \
  --setting "$q32,$g2" --setting "$g3" --setting "" --setting "$old_q,$old_g" --setting "$q32,$g2" --setting "$g3" \
  --json $OUT/confirm.json > $OUT/confirm.log 2>&1
echo "confirm rc $?" | tee -a $OUT/stamps.txt
stamp kernels | tee -a $OUT/stamps.txt
timeout 60 python3 bench/kernel_suite.py --skip-attention --skip-block > $OUT/kernels_after_copy.log 2>&1
timeout 60 python3 bench/kernel_suite.py --skip-copy --skip-attention --skip-block > $OUT/kernels_no_copy.log 2>&1
stamp suite | tee -a $OUT/stamps.txt
timeout 170 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
sed -n '/best first/,$p' $OUT/confirm.log | cut -c1-200
for f in kernels_after_copy kernels_no_copy; do echo "== $f"; grep "^kernel " $OUT/$f.log | cut -c1-110; done
grep -E "^(kernels|attention|block) " $OUT/kernels.log | grep -E "fwd|bwd|ms " | cut -c1-200
