#!/usr/bin/env bash
# H200 session 3: block benchmark with the swept attention tiles; small qualify, diagnose, generate, selftest;
# the `block` preset (real widths, 2 blocks) reference + calibration + gate.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
H="python3 -m flows.cli"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp block; timeout 70 python3 bench/block.py --json $OUT/block.json 2>&1 | tee $OUT/block.log | tail -22
stamp qualify-small; timeout 90 $H qualify --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/qualify_small.log | tail -5
stamp diagnose; timeout 70 $H diagnose --preset small --device cuda --store /tmp/st --auto 2>&1 | tee $OUT/diagnose_small.log | tail -14
stamp generate; timeout 70 $H generate --preset small --device cuda --store /tmp/st --steps 30 2>&1 | tee $OUT/generate_small.log | tail -8
stamp selftest; timeout 110 $H selftest --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/selftest_small.log | tail -22
stamp block-qualify; df -h /tmp | tail -1
timeout $(( 560 - ($(date +%s) - t0) )) $H qualify --preset block --device cuda --store /tmp/sb --providers default,flash,cudnn 2>&1 | tee $OUT/qualify_block.log | tail -8
stamp done; python3 bench/reference_runs.py /tmp/sb | tee $OUT/runs_block.txt; du -sh /tmp/sb; df -h /tmp | tail -1
