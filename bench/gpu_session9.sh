#!/usr/bin/env bash
# H200 session 9 (issues 5 and 2): the `block` qualify to its verdict in one call, now that reference reads run
# ahead on threads (session 7 ran out of its 430 s in the gate, after 77 s of serial provider reports), then the
# gate's candidate run vs a bare candidate fwd+bwd with the reference preloaded. Logs at INFO, stage stamps, $OUT.
source bench/device_env.sh || exit 1
qualify_block 485
python3 - <<'PY' 2>&1 | tee $OUT/verdict_summary.txt
import glob, json
for path in glob.glob("/tmp/st/runs/*-gate-*/verdict.json"):
    d = json.load(open(path))
    print(path.split("/")[-2], "passed", d.get("passed"), "worst", d.get("worst"), "candidate_run", d.get("candidate_run"))
PY
block_runs_and_overhead 85 3
