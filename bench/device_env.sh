# Sourced by bench/gpu_session*.sh on the device machine: the carried wheels on PYTHONPATH, Prefect offline, a timer.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
