#!/usr/bin/env bash
# H200 session 15, call 1 (under 600 s): norm.py's row-loop kernels. The norm and binding tests on CUDA (every
# test, small and real shapes), then bench/norm_sweep.py at S=16384 (its table: bench/results/h200-session15-norm-sweep.log).
# Run at commit 2f0bc87: the sweep's first version and norm.py's knobs it swept; later norm.py kept what won.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 200 python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_binding.py -p no:cacheprovider \
  --durations=4 > $OUT/norm_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|Error" $OUT/norm_tests.log | cut -c1-300 | tail -8
stamp sweep | tee -a $OUT/stamps.txt
timeout 340 python3 bench/norm_sweep.py --json $OUT/norm_sweep.json --budget-s 290 > $OUT/norm_sweep.log 2>&1
echo "sweep rc $?" | tee -a $OUT/stamps.txt
stamp done | tee -a $OUT/stamps.txt
grep -E "^BAD|^skip|Error" $OUT/norm_sweep.log | cut -c1-200 | head -10
sed -n '/best first/,$p' $OUT/norm_sweep.log | cut -c1-150
