#!/usr/bin/env bash
# Session 21, second GPU call (under 200 s): the issue-4 suite on the defaults session 21's sweeps chose
# (GEMV_STAGES 3, the gated backward without its tile prefetch).
source bench/device_env.sh || exit 1
issue4_suite 170
