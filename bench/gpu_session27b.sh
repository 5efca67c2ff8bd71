#!/usr/bin/env bash
# Session 27's second GPU call (under 320 s), straight after gpu_session27.sh while the machine is warm: every CUDA
# test (tests/kernels, with test_compile's sm_90 spill check under the image's triton, and tests/test_compare.py) on
# the current defaults and the new variants' real-width byte checks. Alone in its call: 152 s on an H100 in session
# 18 with fewer tests, and session 26's 60 s step cut them off.
source bench/device_env.sh || exit 1
cuda_tests 290
