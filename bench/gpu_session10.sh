#!/usr/bin/env bash
# H200, session 10 (issue 5): where the gate run's time goes beyond a bare candidate pass. Session 9's block
# gate passed with the run at 1.96x bare (0.523 vs 0.267 s); this splits it into the cold first pass, the
# hooks, the float64 compare (now fewer passes) and the allocator, on a store that holds just what
# gate_overhead needs: the block reference with the default provider.
source bench/device_env.sh || exit 1
stamp tests | tee -a $OUT/stamps.txt
timeout 60 python3 -m pytest -q tests/test_compare.py 2>&1 | tail -3 | tee $OUT/compare_tests.log
stamp reference | tee -a $OUT/stamps.txt
timeout 330 python3 -m flows.cli reference --preset block --device cuda --store /tmp/st --providers default \
  > $OUT/reference_block.log 2>&1
echo "reference rc $?" | tee -a $OUT/stamps.txt; tail -3 $OUT/reference_block.log | cut -c1-160
block_runs_and_overhead 170 3
