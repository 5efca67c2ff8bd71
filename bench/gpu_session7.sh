#!/usr/bin/env bash
# H200 session 7: the `block` qualify (FP32, FP32-alt, three BF16 providers; calibrate; gate) with every stage's
# log line timestamped under $OUT (session 6's copy hit its limit in provider-reports with the logs at WARNING, so
# nothing said where the time went), then the gate's candidate run vs a bare candidate fwd+bwd.
source bench/device_env.sh || exit 1
qualify_block 430
block_runs_and_overhead 110 2
