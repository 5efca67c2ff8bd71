#!/usr/bin/env bash
# Session 23, first GPU call (under 320 s): the sweep session 22 wrote but never ran (gated_residual's backward with the grid's
# axes swapped, residual.GATED_COLS_FIRST, by tile), then the norm, residual and segment tests on CUDA, then the
# issue-4 suite on the current defaults (the card that comes is in stamps.txt: no H200 has run these defaults yet).
source bench/device_env.sh || exit 1
settings=()
for cols_first in 0 1; do for tile in 16,256 8,512 32,256; do
  settings+=(--setting "residual.GATED_COLS_FIRST=$cols_first,residual.GATED_TILE_S=${tile%,*},residual.GATED_BLOCK_H=${tile#*,}")
done; done
step sweeps 50 sweeps.log python3 bench/knob_sweep.py --ops gated_residual --budget-s 40 --json $OUT/sweeps.json \
  "${settings[@]}"
step tests 90 gpu_tests.log python3 -m pytest -q tests/kernels/test_norm.py tests/kernels/test_residual.py \
  tests/kernels/test_segments.py -n 4 -p no:cacheprovider
issue4_suite 150
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -8
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
