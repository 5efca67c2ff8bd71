#!/usr/bin/env bash
# H200 session 15, call 4 (under 400 s): bench/block.py's time_ms now queues a ~1 ms GPU wait before each start event,
# so the events no longer time the host's launches (call 3: gated_residual bwd 0.18 / 0.35 / 0.30 ms in three
# processes at the same constants). The kernels section with and without the copy before it, the whole knob sweep
# again, then the whole suite.
source bench/device_env.sh || exit 1
stamp kernels | tee -a $OUT/stamps.txt
timeout 60 python3 bench/kernel_suite.py --skip-attention --skip-block > $OUT/kernels_after_copy.log 2>&1
timeout 60 python3 bench/kernel_suite.py --skip-copy --skip-attention --skip-block > $OUT/kernels_no_copy.log 2>&1
stamp sweep | tee -a $OUT/stamps.txt
timeout 200 python3 bench/knob_sweep.py --json $OUT/sweep.json --budget-s 150 > $OUT/sweep.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
stamp suite | tee -a $OUT/stamps.txt
timeout 170 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
for f in kernels_after_copy kernels_no_copy; do echo "== $f"; grep "^kernel " $OUT/$f.log | cut -c1-110; done
grep -E "^BAD|^skip|Error" $OUT/sweep.log | cut -c1-200 | head -6
sed -n '/best first/,$p' $OUT/sweep.log | awk '{print substr($0,1,170)}' | awk 'NR<3 || c[$1" "$2]++ < 4'
grep -E "^(kernels|block) " $OUT/kernels.log | grep -E "fwd|bwd|ms " | cut -c1-200
