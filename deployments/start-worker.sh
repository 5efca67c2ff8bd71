#!/usr/bin/env bash
# Start one h3gate Prefect worker, pinned to the GPUs it serves.
#
#   deployments/start-worker.sh GPUS [POOL] [-- extra `prefect worker start` options]
#
#   GPUS   CUDA_VISIBLE_DEVICES for this worker: "0" (one GPU), "0,1" (a reference fans its provider
#          runs out over both), or "cpu" for the CPU pool (no GPU; Triton's interpreter).
#   POOL   work pool (default h3-gpu, or h3-cpu for GPUS=cpu).
#
# The site's settings come from the environment, never from this file or prefect.yaml:
#   PREFECT_API_URL        the Prefect server (required)
#   H3GATE_STORE           store URL (local folder, s3://bucket/prefix); H3GATE_STORAGE_OPTIONS (JSON)
#   AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL   for S3 stores (s3fs reads them)
#   H3GATE_PROJECT_DIR     the checkout the flows run from (default: this script's repository)
#   H3GATE_PYTHON          the Python with h3gate installed (default: python on PATH)
# Stop it with SIGINT (Ctrl-C) twice: a worker ignores SIGTERM while it has runs.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
gpus=$1; shift
if [[ $gpus == cpu ]]; then pool=h3-cpu; else pool=h3-gpu; fi
if [[ $# -gt 0 && $1 != -- ]]; then pool=$1; shift; fi
if [[ ${1:-} == -- ]]; then shift; fi

: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server, e.g. http://<server>:4200/api}"
export H3GATE_PROJECT_DIR=${H3GATE_PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
if [[ $gpus == cpu ]]; then
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
  name=${HOSTNAME:-worker}-cpu
else
  export CUDA_VISIBLE_DEVICES=$gpus
  name=${HOSTNAME:-worker}-gpu${gpus//,/-}
fi

cd "$H3GATE_PROJECT_DIR"
exec "${H3GATE_PYTHON:-python}" -m prefect worker start --pool "$pool" --type process --name "$name" "$@"
