#!/usr/bin/env bash
# Session 20, second GPU call (under 300 s): every CUDA test, on the two-piece norms and the gated backward's prefetch
# (session 19c's call, never run).
source bench/device_env.sh || exit 1
cuda_tests 280
