#!/usr/bin/env bash
# H200 session 7: the `block` qualify (FP32, FP32-alt, three BF16 providers; calibrate; gate) with every stage's
# log line timestamped under $OUT (session 6's copy hit its limit in provider-reports with the logs at WARNING, so
# nothing said where the time went), then the gate's candidate run vs a bare candidate fwd+bwd.
source bench/device_env.sh || exit 1
export PREFECT_LOGGING_LEVEL=INFO
stamp qualify | tee $OUT/stamps.txt
/usr/bin/time -f "qualify wall %e s" timeout 430 python3 -m flows.cli qualify --preset block --device cuda \
  --store /tmp/st --providers default,flash,cudnn > $OUT/qualify_block.log 2>&1
echo "qualify rc $?" | tee -a $OUT/stamps.txt
grep -E "Finished in state|verified|PASS|FAIL|verdict|worst|wall" $OUT/qualify_block.log | cut -c1-160 | tail -25
stamp runs | tee -a $OUT/stamps.txt
python3 bench/reference_runs.py /tmp/st block > $OUT/block_runs.txt 2>&1; cat $OUT/block_runs.txt; df -h /tmp | tail -1
stamp overhead | tee -a $OUT/stamps.txt
timeout 110 python3 bench/gate_overhead.py /tmp/st --preset block --reps 2 > $OUT/gate_overhead_block.log 2>&1
echo "overhead rc $?"; tail -7 $OUT/gate_overhead_block.log
stamp done | tee -a $OUT/stamps.txt
