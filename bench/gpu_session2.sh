#!/usr/bin/env bash
# H200 session 2: attention backward sweep, fused-kernel + block benchmark, kernel/binding GPU tests, small qualify.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 bench/attention.py --sweep bench/attention_sweep.txt 2>&1 | tee $OUT/sweep.log | tail -30
timeout 150 python3 bench/kernel_suite.py --skip-attention --json $OUT/kernels.json 2>&1 | tee $OUT/kernels.log | tail -40
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_binding.py tests/kernels/test_attention.py -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -8
timeout 130 python3 -m flows.cli qualify --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/qualify_small.log | tail -8
