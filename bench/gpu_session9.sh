#!/usr/bin/env bash
# H200, next session (issues 5 and 2): the `block` qualify to its verdict in one call, now that reference reads run
# ahead on threads (session 7 ran out of its 430 s in the gate, after 77 s of serial provider reports), then the
# gate's candidate run vs a bare candidate fwd+bwd with the reference preloaded. Logs at INFO, stage stamps, $OUT.
source bench/device_env.sh || exit 1
export PREFECT_LOGGING_LEVEL=INFO
stamp qualify | tee $OUT/stamps.txt
/usr/bin/time -f "qualify wall %e s" timeout 470 python3 -m flows.cli qualify --preset block --device cuda \
  --store /tmp/st --providers default,flash,cudnn > $OUT/qualify_block.log 2>&1
echo "qualify rc $?" | tee -a $OUT/stamps.txt
grep -E "Finished in state|verified|PASS|FAIL|worst|wall|first drift" $OUT/qualify_block.log | cut -c1-160 | tail -22
python3 - <<'PY' 2>&1 | tee $OUT/verdict_summary.txt
import glob, json
for path in glob.glob("/tmp/st/runs/*-gate-*/verdict.json"):
    d = json.load(open(path))
    print(path.split("/")[-2], "passed", d.get("passed"), "worst", d.get("worst"), "candidate_run", d.get("candidate_run"))
PY
stamp runs | tee -a $OUT/stamps.txt
python3 bench/reference_runs.py /tmp/st block > $OUT/block_runs.txt 2>&1; cat $OUT/block_runs.txt
stamp overhead | tee -a $OUT/stamps.txt
timeout 100 python3 bench/gate_overhead.py /tmp/st --preset block --reps 3 > $OUT/gate_overhead_block.log 2>&1
echo "overhead rc $?"; tail -9 $OUT/gate_overhead_block.log
stamp done | tee -a $OUT/stamps.txt
