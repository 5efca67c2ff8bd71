#!/usr/bin/env bash
# H200 session 1: kernel GPU tests, attention benchmark, `small` reference + calibration on the CUDA providers.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton, diffusers, prefect; print(torch.__version__, triton.__version__, diffusers.__version__, prefect.__version__)" | tee -a $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -25
timeout 120 python3 bench/attention.py 2>&1 | tee $OUT/bench_attention.log
timeout 180 python3 -m flows.cli reference --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/ref_small.log | tail -12
timeout 60 python3 -m flows.cli calibrate --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/cal_small.log | tail -20
python3 bench/reference_runs.py /tmp/st | tee $OUT/runs_small.txt
