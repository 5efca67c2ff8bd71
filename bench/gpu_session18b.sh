#!/usr/bin/env bash
# Session 18, second GPU call (under 400 s; the card is the first line of stamps.txt):
#   - tests/kernels/test_norm.py on CUDA: the qk per-tile check against the per-row read at the same tile, and the
#     norm backwards' prefetch keeping every gradient's bytes;
#   - which of qk_norm_rope's dx bytes move with the row tile on CUDA (bench/qk_tile_bytes.py);
#   - the norm backwards with and without the prefetch, at 16 (the default) and 32 warps (bench/knob_sweep.py).
# It ran (bench/results/h100-session18b-*) with one NORM_BWD_PREFETCH for both norms, off by default; the result
# split it into RMS_NORM_BWD_PREFETCH (on) and MODULATE_BWD_PREFETCH (off), the names the sweep below now sets.
source bench/device_env.sh || exit 1
step tests 150 norm_tests.log python3 -m pytest -q tests/kernels/test_norm.py -n 4 -p no:cacheprovider
grep -E "passed|failed|FAILED|ERROR" $OUT/norm_tests.log | cut -c1-300 | tail -8
step qk-bytes 60 qk_tile_bytes.log python3 bench/qk_tile_bytes.py
off=norm.RMS_NORM_BWD_PREFETCH=0,norm.MODULATE_BWD_PREFETCH=0
on=norm.RMS_NORM_BWD_PREFETCH=1,norm.MODULATE_BWD_PREFETCH=1
step sweep 150 norm_sweep.log python3 bench/knob_sweep.py --ops norm --setting "$off" --setting "$on" \
  --setting "$off,norm.NORM_BWD_WARPS=32" --setting "$on,norm.NORM_BWD_WARPS=32" --json $OUT/norm_sweep.json
stamp done | tee -a $OUT/stamps.txt
tail -8 $OUT/qk_tile_bytes.log
sed -n '/best first/,$p' $OUT/norm_sweep.log | cut -c1-170
