# Sourced by bench/gpu_session*.sh on the device machine: the carried wheels on PYTHONPATH, Prefect offline, a timer,
# and the steps more than one session runs.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90 PREFECT_LOGGING_LEVEL=WARNING
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# The card first in stamps.txt: a call asked for an H200 may run on an H100.
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee -a $OUT/stamps.txt

# step NAME LIMIT_S LOG CMD...: stamp NAME, run CMD under the limit with its output in $OUT/LOG, print its rc.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  stamp "$name" | tee -a $OUT/stamps.txt
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  echo "$name rc $?" | tee -a $OUT/stamps.txt
}

# The `block` qualify on a fresh /tmp/st (three BF16 providers), Prefect logs at INFO in $OUT/qualify_block.log,
# its stage lines printed: qualify_block TIMEOUT_S (sessions 7 and 9).
qualify_block() {
  stamp qualify | tee -a $OUT/stamps.txt
  PREFECT_LOGGING_LEVEL=INFO /usr/bin/time -f "qualify wall %e s" timeout "$1" python3 -m flows.cli qualify \
    --preset block --device cuda --store /tmp/st --providers default,flash,cudnn > $OUT/qualify_block.log 2>&1
  echo "qualify rc $?" | tee -a $OUT/stamps.txt
  grep -E "Finished in state|verified|PASS|FAIL|worst|wall|first drift" $OUT/qualify_block.log | cut -c1-160 | tail -25
}

# Then the runs table of /tmp/st and the gate run vs a bare candidate: block_runs_and_overhead TIMEOUT_S REPS.
block_runs_and_overhead() {
  stamp runs | tee -a $OUT/stamps.txt
  python3 bench/reference_runs.py /tmp/st block > $OUT/block_runs.txt 2>&1; cat $OUT/block_runs.txt; df -h /tmp | tail -1
  stamp overhead | tee -a $OUT/stamps.txt
  timeout "$1" python3 bench/gate_overhead.py /tmp/st --preset block --reps "$2" > $OUT/gate_overhead_block.log 2>&1
  echo "overhead rc $?"; tail -9 $OUT/gate_overhead_block.log
  stamp done | tee -a $OUT/stamps.txt
}

# Every CUDA test (tests/kernels and tests/test_compare.py, four xdist workers sharing the GPU so that Triton's
# compiles overlap: session 17's serial run hit its 100 s limit), its verdict printed: cuda_tests TIMEOUT_S.
cuda_tests() {
  step tests "$1" gpu_tests.log python3 -m pytest -q tests/kernels tests/test_compare.py -n 4 -p no:cacheprovider \
    --durations=10
  grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | cut -c1-300 | tail -12
}

# The whole issue-4 suite (bench/kernel_suite.py) on the checked-out defaults: its closing table printed, or, for a
# suite its limit cut off before the table (whose first rows start "kernels "), the progress lines of the sections
# that finished: issue4_suite TIMEOUT_S.
issue4_suite() {
  step suite "$1" kernels.log python3 bench/kernel_suite.py --json $OUT/kernels.json
  stamp done | tee -a $OUT/stamps.txt
  local lines="^(kernel|attention|block) "
  grep -q "^kernels " $OUT/kernels.log && lines="^(kernels |attention  |block  )"
  grep -E "$lines" $OUT/kernels.log | grep -v "rel-L2 vs fp32 d[Wh ]" | cut -c1-200
}
