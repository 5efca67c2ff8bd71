#!/usr/bin/env bash
# Session 19, third GPU call (under 400 s; the card is the first line of stamps.txt): a verdict of every CUDA test on
# the two-piece norm kernels, then the whole issue-4 suite on the final defaults. Never ran: every start after 19b was
# refused; session 20's first call (gpu_session20.sh) does its work.
source bench/device_env.sh || exit 1
cuda_tests 300
issue4_suite 170
