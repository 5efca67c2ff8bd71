#!/usr/bin/env bash
# Session 23's third GPU call (under 200 s), which got no machine then (refused starts spent that session's device
# time); it ran in session 26 on an H100 (190 s; bench/results/h100-session26-*), where the suite and the tests ran
# past their limits (90 s, 60 s). In this order: the issue-4 suite on session 23's new defaults (norm finish 256 x 16,
# gated tile 8 x 512); the norm and residual tests on CUDA with them; modulation.finish_segments' step shape
# (FINISH_BLOCK_P partials per step over 4096 / P columns; qk_norm_rope's d_weight finish was one program of 50
# steps) on the ops that call it.
source bench/device_env.sh || exit 1
# The suite first (session 26): refused starts spent most of the device time, and what ran before a cut-off comes back.
issue4_suite 90
step tests 60 gpu_tests.log python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_residual.py \
  -n 4 -p no:cacheprovider
step finish 50 finish.log python3 bench/knob_sweep.py --ops seg_finish --budget-s 30 --json $OUT/finish.json
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -8
sed -n '/best first/,$p' $OUT/finish.log | cut -c1-170
