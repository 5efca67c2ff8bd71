"""Launch settings of h3kernels/norm.py's backward, timed at the real width: which ones its defaults get.

    python bench/norm_sweep.py [--seqlen 16384] [--json $OUT/norm_sweep.json]   # on the H200: about 1-2 minutes
    python bench/norm_sweep.py --smoke                                          # CPU, TRITON_INTERPRET=1

Each setting is a pair of norm.py's module constants (NORM_BWD_WARPS, NORM_BWD_CHUNKS), applied before the op
runs. rms_norm_modulate's and rms_norm's backward are timed as bench/kernel_suite.py times them (its cases, bytes and
L2 flush: bf16, S rows, H 5376, the real packed layout's indices). Every setting computes the same math, so each
one's largest rel-L2 to the bf16 torch baseline (0.11 for rms_norm_modulate: the baseline's bf16 table gradient) must
stay within 1.5x of the op's smallest; a setting past that, or one that fails, is printed BAD and the exit code is
1. The table, best first per op, comes last.

bench/results/h200-session15-norm-sweep.log came from this script's first version (commit 2f0bc87), which also
swept forward row loops, a table-factor cache and a two-launch backward; norm.py kept what won there, and this
version sweeps the knobs that remain.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from bench import block as block_bench  # noqa: E402
from bench import kernel_suite  # noqa: E402

OPS = ("rms_norm_modulate", "rms_norm")
SAME_MATH = 1.5  # largest allowed ratio of a setting's rel-L2 to the op's smallest


def settings(smoke: bool) -> list[dict[str, Any]]:
    """Backward settings to time (one under --smoke)."""
    if smoke:
        return [dict(NORM_BWD_WARPS=4, NORM_BWD_CHUNKS=3)]
    return [dict(NORM_BWD_WARPS=w, NORM_BWD_CHUNKS=n) for w, n in itertools.product((8, 16, 32), (100, 132, 200, 264))]


def apply(setting: dict[str, Any]) -> dict[str, Any]:
    """Set norm.py's constants; returns the previous values."""
    from h3kernels import norm

    old = {k: getattr(norm, k) for k in setting}
    for k, v in setting.items():
        setattr(norm, k, v)
    return old


def measure(setting: dict[str, Any], S: int, device: torch.device, copy_GBps: float,
            flush: torch.Tensor | None, warmup: int, iters: int) -> list[dict[str, Any]]:
    builders = {b.__name__: b for b in kernel_suite.kernel_cases("tiny" if device.type == "cpu" else "block", S,
                                                                  device)}
    out = []
    old = apply(setting)
    try:
        for op, builder in zip(OPS, (builders["norm_modulate"], builders["norm"]), strict=True):
            rec: dict[str, Any] = {"op": op, "setting": setting}
            try:
                case = builder()
                rec["rel_l2_vs_bf16_torch"] = kernel_suite._check_close(case, device)
                _, ms = kernel_suite._fwd_bwd(case.cand, case.cand_grads, device, flush, warmup, iters)
                rec.update(ms=ms, GBps=case.bwd_bytes / ms / 1e6, pct_copy=case.bwd_bytes / ms / 1e6 / copy_GBps)
                del case
            except Exception as err:  # noqa: BLE001 (a setting that fails to compile must not end the sweep)
                traceback.print_exc()
                rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            out.append(rec)
            block_bench.free(device)
    finally:
        apply(old)
    return out


def label(setting: dict[str, Any]) -> str:
    return " ".join(f"{k.removeprefix('NORM_').lower()}={v}" for k, v in setting.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny widths, S=96")
    parser.add_argument("--json", type=Path, default=None, help="write every record here")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new settings after this")
    args = parser.parse_args(argv)
    device = block_bench.bench_device(args.smoke, "bench/norm_sweep.py")
    if device is None:
        return 0
    S = 96 if args.smoke else args.seqlen
    warmup, iters = (1, 2) if args.smoke else (kernel_suite.KERNEL_WARMUP, kernel_suite.KERNEL_ITERS)
    copy = kernel_suite.copy_bandwidth(device, kernel_suite.COPY_BYTES_SMOKE if args.smoke else 1 << 30)
    print(f"copy {copy['GBps']:.0f} GB/s", flush=True)
    flush = (torch.empty(kernel_suite.FLUSH_BYTES // 4, device=device, dtype=torch.float32)
             if device.type == "cuda" else None)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for setting in settings(args.smoke):
        if time.monotonic() - t0 > args.budget_s:
            print(f"skip {label(setting)}: past the {args.budget_s:.0f} s budget", flush=True)
            continue
        for rec in measure(setting, S, device, copy["GBps"], flush, warmup, iters):
            records.append(rec)
            print(f"bwd {rec['op']} {label(setting)}: "
                  + (rec["error"] if "error" in rec else f"{rec['ms']:.3f} ms {rec['pct_copy']:.0%} of copy, "
                     f"rel-L2 {rec['rel_l2_vs_bf16_torch']:.1e}"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"S": S, "copy": copy, "records": records}, indent=1))
    least = {op: min((r["rel_l2_vs_bf16_torch"] for r in records if r["op"] == op and "error" not in r),
                     default=0.0) for op in OPS}
    bad = [r for r in records if "error" in r or r["rel_l2_vs_bf16_torch"] > SAME_MATH * least[r["op"]] + 1e-6]
    print(f"\nS={S}, copy {copy['GBps']:.0f} GB/s; backward, best first per op")
    print(f"{'op':<18} {'ms':>7} {'% copy':>7}  setting")
    for op in OPS:
        for r in sorted((r for r in records if r["op"] == op and "error" not in r), key=lambda r: r["ms"]):
            print(f"{op:<18} {r['ms']:>7.3f} {r['pct_copy']:>7.0%}  {label(r['setting'])}")
    for r in bad:
        print(f"BAD {r['op']} {label(r['setting'])}: {r.get('error') or r['rel_l2_vs_bf16_torch']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
