"""Launch settings of h3kernels/norm.py's row-loop kernels, timed at the real width: which ones its defaults get.

    python bench/norm_sweep.py [--seqlen 16384] [--json $OUT/norm_sweep.json]   # on the H200: about 2-4 minutes
    python bench/norm_sweep.py --smoke                                          # CPU, TRITON_INTERPRET=1

Each setting is a set of norm.py's module constants (NORM_FWD_WARPS, NORM_CACHE_TABLE, NORM_FWD_PROGRAMS for the
forward; NORM_BWD_WARPS, NORM_CACHE_TABLE, NORM_BWD_FUSED, NORM_BWD_CHUNKS for the backward), applied before the
op runs. rms_norm_modulate and rms_norm are timed as bench/kernel_suite.py times them (its cases, bytes and L2
flush: bf16, S rows, H 5376, the real packed layout's indices). Every setting computes the same math, so each one's
largest rel-L2 to the bf16 torch baseline (0.11 for rms_norm_modulate: the baseline's bf16 table gradient) must
stay within 1.5x of the op's smallest; a setting past that, or one that fails, is printed BAD and the exit code is
1. The table, best first per op and direction, comes last.
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


def settings(smoke: bool) -> dict[str, list[dict[str, Any]]]:
    """Forward and backward settings to time (one of each under --smoke)."""
    if smoke:
        return {"fwd": [dict(NORM_FWD_WARPS=4, NORM_CACHE_TABLE=True, NORM_FWD_PROGRAMS=4)],
                "bwd": [dict(NORM_BWD_WARPS=4, NORM_CACHE_TABLE=False, NORM_BWD_FUSED=False, NORM_BWD_CHUNKS=3)]}
    fwd = [dict(NORM_FWD_WARPS=w, NORM_CACHE_TABLE=c, NORM_FWD_PROGRAMS=p)
           for w, c, p in itertools.product((8, 16, 32), (True, False), (528, 1056, 4096, 16384))]
    bwd = [dict(NORM_BWD_WARPS=w, NORM_CACHE_TABLE=c, NORM_BWD_FUSED=f, NORM_BWD_CHUNKS=n)
           for w, c, f, n in itertools.product((16, 32), (True, False), (True, False), (132, 264, 528))]
    bwd += [dict(NORM_BWD_WARPS=8, NORM_CACHE_TABLE=False, NORM_BWD_FUSED=f, NORM_BWD_CHUNKS=264)
            for f in (True, False)]
    return {"fwd": fwd, "bwd": bwd}


def apply(setting: dict[str, Any]) -> dict[str, Any]:
    """Set norm.py's constants; returns the previous values."""
    from h3kernels import norm

    old = {k: getattr(norm, k) for k in setting}
    for k, v in setting.items():
        setattr(norm, k, v)
    return old


def measure(direction: str, setting: dict[str, Any], S: int, device: torch.device, copy_GBps: float,
            flush: torch.Tensor | None, warmup: int, iters: int) -> list[dict[str, Any]]:
    builders = {b.__name__: b for b in kernel_suite.kernel_cases("tiny" if device.type == "cpu" else "block", S,
                                                                  device)}
    out = []
    old = apply(setting)
    try:
        for op, builder in zip(OPS, (builders["norm_modulate"], builders["norm"]), strict=True):
            rec: dict[str, Any] = {"op": op, "dir": direction, "setting": setting}
            try:
                case = builder()
                rec["rel_l2_vs_bf16_torch"] = kernel_suite._check_close(case, device)
                fwd_ms, bwd_ms = kernel_suite._fwd_bwd(case.cand, case.cand_grads, device, flush, warmup, iters)
                ms = fwd_ms if direction == "fwd" else bwd_ms
                nbytes = case.fwd_bytes if direction == "fwd" else case.bwd_bytes
                rec.update(ms=ms, GBps=nbytes / ms / 1e6, pct_copy=nbytes / ms / 1e6 / copy_GBps)
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
    for direction, group in settings(args.smoke).items():
        for setting in group:
            if time.monotonic() - t0 > args.budget_s:
                print(f"skip {direction} {label(setting)}: past the {args.budget_s:.0f} s budget", flush=True)
                continue
            for rec in measure(direction, setting, S, device, copy["GBps"], flush, warmup, iters):
                records.append(rec)
                print(f"{direction} {rec['op']} {label(setting)}: "
                      + (rec["error"] if "error" in rec else f"{rec['ms']:.3f} ms {rec['pct_copy']:.0%} of copy, "
                         f"rel-L2 {rec['rel_l2_vs_bf16_torch']:.1e}"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"S": S, "copy": copy, "records": records}, indent=1))
    least = {op: min((r["rel_l2_vs_bf16_torch"] for r in records if r["op"] == op and "error" not in r),
                     default=0.0) for op in OPS}
    bad = [r for r in records if "error" in r or r["rel_l2_vs_bf16_torch"] > SAME_MATH * least[r["op"]] + 1e-6]
    print(f"\nS={S}, copy {copy['GBps']:.0f} GB/s; best first per op and direction")
    print(f"{'op':<18} {'dir':<4} {'ms':>7} {'% copy':>7}  setting")
    for op, direction in itertools.product(OPS, ("fwd", "bwd")):
        rows = sorted((r for r in records if r["op"] == op and r["dir"] == direction and "error" not in r),
                      key=lambda r: r["ms"])
        for r in rows:
            print(f"{op:<18} {direction:<4} {r['ms']:>7.3f} {r['pct_copy']:>7.0%}  {label(r['setting'])}")
    for r in bad:
        print(f"BAD {r['op']} {r['dir']} {label(r['setting'])}: {r.get('error') or r['rel_l2_vs_bf16_torch']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
