#!/usr/bin/env bash
# Session 22, fourth GPU call (under 90 s): gated_residual's backward by row-chunk count and prefetch, whether the
# programs' waves are the loss (1344 programs at 64 chunks: 2.5 waves of four per SM, 3.4 of three with the prefetch;
# 100 chunks: 3.7 / 5.0 waves).
source bench/device_env.sh || exit 1
settings=()
for prefetch in 0 1; do for chunks in 64 100 128 256; do
  settings+=(--setting "residual.GATED_PREFETCH=$prefetch,residual.GATED_CHUNKS=$chunks")
done; done
step sweeps 70 sweeps.log python3 bench/knob_sweep.py --ops gated_residual --budget-s 55 --json $OUT/sweeps.json \
  "${settings[@]}"
sed -n '/best first/,$p' $OUT/sweeps.log | cut -c1-170
