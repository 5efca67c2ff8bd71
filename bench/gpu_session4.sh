#!/usr/bin/env bash
# H200 session 4 (short): small qualify, then the generation gate on the verdict it leaves.
source bench/device_env.sh || exit 1
stamp qualify; timeout 130 python3 -m flows.cli qualify --preset small --device cuda --store /tmp/st 2>&1 | tee $OUT/qualify_small.log | grep -vE "INFO|Warning" | tail -5
stamp generate; timeout 80 python3 -m flows.cli generate --preset small --device cuda --store /tmp/st --steps 30 2>&1 | tee $OUT/generate_small.log | grep -vE "INFO|Warning" | tail -12
stamp done
