#!/usr/bin/env bash
# H200, next session: the two binding tests session 11 failed, after their fixes (deterministic before/after
# unbind runs on CUDA; the adaln gradient bound per preset), then the rest of the binding tests.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 240 python3 -m pytest -q tests/kernels/test_binding.py -p no:cacheprovider --durations=5 \
  > $OUT/binding_tests.log 2>&1
echo "pytest rc $?" | tee -a $OUT/stamps.txt
grep -E "passed|failed|FAILED|ERROR|adaln_proj weight" $OUT/binding_tests.log | cut -c1-300 | tail -12
stamp done | tee -a $OUT/stamps.txt
