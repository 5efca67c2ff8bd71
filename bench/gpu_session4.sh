#!/usr/bin/env bash
# H200 session 4 (short): small qualify, then the generation gate on the verdict it leaves.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp qualify; timeout 130 python3 -m flows.cli qualify --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/qualify_small.log | grep -vE "INFO|Warning" | tail -5
stamp generate; timeout 80 python3 -m flows.cli generate --preset small --device cuda --store /tmp/st --steps 30 2>&1 | tee $OUT/generate_small.log | grep -vE "INFO|Warning" | tail -12
stamp done
