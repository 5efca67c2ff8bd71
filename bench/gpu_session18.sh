#!/usr/bin/env bash
# Session 18, one GPU call (under 580 s; the card it ran on is the first line of stamps.txt): a verdict of every
# CUDA test, then the whole issue-4 suite on main's defaults.
source bench/device_env.sh || exit 1
cuda_tests 330
issue4_suite 170
