#!/usr/bin/env bash
# H200 session 14, call 5: SM clock and power while bench/attention.py (randn, S=16384) runs and while
# bench/block_profile.py runs the block: is the block's attention slower because the GPU clocks down?
# nvidia-smi samples every 100 ms; each phase's samples are summarised by clocks_summary below.
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 100 > $OUT/clocks.csv 2>&1 &
smi=$!
mark() { echo "$(date '+%Y/%m/%d %H:%M:%S.%3N') $1" >> $OUT/phases.txt; }
mark attention-start
timeout 120 python3 bench/attention.py --seqlens 16384 --iters 40 > $OUT/attention.log 2>&1
mark attention-end
mark profile-start
timeout 150 python3 bench/block_profile.py --top 6 > $OUT/block_profile.log 2>&1
mark profile-end
kill $smi
python3 - $OUT <<'PY'
import csv, statistics, sys
from datetime import datetime
out = sys.argv[1]
rows = [r for r in csv.reader(open(f"{out}/clocks.csv")) if len(r) == 5]
t = lambda s: datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f")
samples = [(t(r[0]), float(r[1]), float(r[2]), float(r[3]), r[4].strip()) for r in rows]
marks = {ln.split()[2]: t(" ".join(ln.split()[:2])) for ln in open(f"{out}/phases.txt")}
for phase in ("attention", "profile"):
    s = [x for x in samples if marks[phase + "-start"] <= x[0] <= marks[phase + "-end"] and x[2] > 200]
    if s:
        print(f"{phase:<10} busy samples {len(s):4d}  SM MHz median {statistics.median(x[1] for x in s):.0f} "
              f"min {min(x[1] for x in s):.0f}  power W median {statistics.median(x[2] for x in s):.0f} "
              f"max {max(x[2] for x in s):.0f}  temp max {max(x[3] for x in s):.0f}  "
              f"throttle reasons {sorted(set(x[4] for x in s))[:4]}")
PY
grep -E "^16384" $OUT/attention.log | cut -c1-120
grep -E "^kernel|^pass" $OUT/block_profile.log | cut -c1-170 | head -8
