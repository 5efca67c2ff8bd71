#!/usr/bin/env bash
# Session 26's second GPU call (under 340 s), for the next session: the session's one call ran the suite before
# modulation.finish_segments took 256 x 16 steps, and the suite (90 s) and the tests (60 s) ran past their limits on
# the H100 that came. So: the issue-4 suite on the new default, whole (its closing table has SDPA's TFLOP/s), then
# every CUDA test (tests/kernels and tests/test_compare.py: 152 s on an H100 in session 18).
source bench/device_env.sh || exit 1
issue4_suite 150
cuda_tests 180
