#!/usr/bin/env bash
# H200 session 15, call 6 (under 150 s): qk_norm_rope's backward program count at 8 rows x 2 warps (6 programs fit
# an SM at 147 registers x 64 threads, so 1024 programs are 1.3 waves): 528, 792, 1024, 1584, each twice.
source bench/device_env.sh || exit 1
q=qk_norm_rope.QK_BWD_PROGRAMS
timeout 120 python3 bench/knob_sweep.py --ops qk_norm_rope --setting $q=528 --setting $q=792 --setting $q=1024 \
  --setting $q=1584 --setting $q=528 --setting $q=792 --setting $q=1024 --setting $q=1584 > $OUT/qk_programs.log 2>&1
echo "sweep rc $?"
sed -n '/best first/,$p' $OUT/qk_programs.log | grep bwd
