#!/usr/bin/env bash
# H200 session 15, call 2 (under 600 s): norm.py as kept after call 1 (one fused backward, touched flags). The norm,
# residual and segment tests on CUDA; bench/kernel_suite.py with the defaults (every fused kernel, attention, the
# block at S=4096/16384); then bench/knob_sweep.py (norm backward, qk_norm_rope and gated_residual launch constants
# at S=16384) in the time left.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 150 python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_residual.py \
  tests/kernels/test_segments.py -p no:cacheprovider --durations=4 > $OUT/kernel_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/kernel_tests.log | cut -c1-300 | tail -8
stamp suite | tee -a $OUT/stamps.txt
timeout 170 python3 bench/kernel_suite.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1
echo "suite rc $?" | tee -a $OUT/stamps.txt
stamp sweep | tee -a $OUT/stamps.txt
left=$(( 520 - ($(date +%s) - t0) ))
timeout $(( left + 40 )) python3 bench/knob_sweep.py --json $OUT/sweep.json --budget-s $left > $OUT/sweep.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -E "^BAD|^skip|Error" $OUT/sweep.log | cut -c1-200 | head -10
grep -E "^(kernels|attention|block) " $OUT/kernels.log | grep -E "fwd|bwd|ms " | cut -c1-200
sed -n '/best first/,$p' $OUT/sweep.log | awk '{print substr($0,1,170)}' | awk 'NR<3 || c[$1" "$2]++ < 4'
