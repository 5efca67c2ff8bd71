#!/usr/bin/env bash
# H200 session 5: the `block` model split into two ranges on one GPU vs unsplit (byte identity, with deterministic
# algorithms) and the memory planner vs measured allocations (bench/placement.py).
source bench/device_env.sh || exit 1
stamp plan; python3 -m flows.cli plan --preset block --device cuda --dtype float32 2>&1 | tee $OUT/plan_block.txt | tail -2
stamp placement; timeout 540 python3 bench/placement.py --preset block --device cuda --deterministic \
  --runs float32:fp32,bfloat16:default \
  --out $OUT/block_memory.json 2>&1 | tee $OUT/placement_block.log | grep -vE "INFO|Warning" | tail -6
stamp done
