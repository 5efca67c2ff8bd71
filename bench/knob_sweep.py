"""Launch constants of h3kernels' row-wise kernels, timed at the real width: which values their defaults get.

    python bench/knob_sweep.py [--ops norm,norm_bwd,norm_finish,norm_runs,norm_fwd,qk_norm_rope,qk_prefetch,
                               gated_residual,seg_finish,adaln_stages]
                               [--seqlen 16384] [--json $OUT/sweep.json]
    python bench/knob_sweep.py --ops gated_residual --setting residual.GATED_WARPS=4 --setting residual.GATED_WARPS=8
    python bench/knob_sweep.py --smoke                                         # CPU, TRITON_INTERPRET=1

Each setting assigns module constants ("module.CONST": value, see KNOBS) before the ops of its group run; they are
timed as bench/kernel_suite.py times them (its cases, bytes and L2 flush: bf16, S rows, H 5376, 56 x 128 heads, the
real packed layout's indices), forward and backward, against the measured copy bandwidth. Every setting computes
the same math, so each one's largest rel-L2 to the bf16 torch baseline (0.11 for rms_norm_modulate and
gated_residual: the baseline's bf16 table gradient) must stay within 1.5x of the op's smallest plus 1e-3 (rms_norm's
is ~2e-5, and its weight gradient's bf16 roundings move with the chunk count); a setting past
that, or one that fails, is printed BAD and the exit code is 1. The tables, best first per op and direction, come
last; --budget-s stops starting new settings (the rest print "skip"). --setting (repeatable, "module.CONST=value,...";
an empty one is the defaults) times the given settings instead of the groups' grids, e.g. to confirm a winner.

bench/results/h200-session15-norm-sweep.log came from this script's first version, bench/norm_sweep.py at commit
2f0bc87, which also swept norm.py's forward row loops, a table-factor cache and a two-launch backward; norm.py kept
what won there.
"""

from __future__ import annotations

import argparse
import importlib
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

SAME_MATH = 1.5  # largest allowed ratio of a setting's rel-L2 to the op's smallest ...
SAME_MATH_FLOOR = 1e-3  # ... plus this: bf16 roundings that a different (fixed) reduction order flips


def _grid(**values: tuple[Any, ...]) -> list[dict[str, Any]]:
    return [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]


def _qk_grid() -> list[dict[str, Any]]:
    """The same (rows, warps) tile for the forward and the backward, and the backward's program count."""
    return [{"qk_norm_rope.QK_FWD_ROWS": r, "qk_norm_rope.QK_FWD_WARPS": w, "qk_norm_rope.QK_BWD_ROWS": r,
             "qk_norm_rope.QK_BWD_WARPS": w, "qk_norm_rope.QK_BWD_PROGRAMS": p}
            for r, w, p in itertools.product((8, 16, 32, 64), (2, 4, 8), (1024, 4096)) if r * 128 // (32 * w) <= 64]


def _finish_shapes(block_p: str, block_cols: str, partials: tuple[int, ...]) -> list[dict[str, Any]]:
    """A finish kernel's step shape: `partials` rows per step over the 4096 / P columns that fit the same tile."""
    return [{block_p: p, block_cols: 4096 // p} for p in partials]


def _finish_rows() -> list[dict[str, Any]]:
    """norm.py's finish with all of a block's 6 table rows in one step: partials per step x 8 rows x columns."""
    return [{"norm.FINISH_BLOCK_P": p, "norm.FINISH_BLOCK_R": 8, "norm.FINISH_BLOCK_H": h}
            for p, h in ((256, 2), (256, 4), (128, 4), (128, 8))]


def _gated_grid() -> list[dict[str, Any]]:
    """Backward tiles of at most 8192 values (the running tile stays in registers)."""
    return [{"residual.GATED_TILE_S": t, "residual.GATED_BLOCK_H": h, "residual.GATED_WARPS": w,
             "residual.GATED_CHUNKS": c}
            for t, h, w, c in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (64, 128, 256)) if t * h <= 8192]


# group -> (kernel_suite builder names, settings on the GPU, the one setting under --smoke)
KNOBS: dict[str, tuple[tuple[str, ...], Any, dict[str, Any]]] = {
    "norm": (("norm_modulate", "norm"),
             lambda: _grid(**{"norm.NORM_BWD_WARPS": (8, 16, 32), "norm.NORM_BWD_CHUNKS": (100, 132, 200, 264)}),
             {"norm.NORM_BWD_WARPS": 4, "norm.NORM_BWD_CHUNKS": 3}),
    "norm_bwd": (("norm_modulate", "norm"),
                 lambda: [{"norm.MODULATE_BWD_SPLIT": s, "norm.RMS_NORM_BWD_SPLIT": s, "norm.NORM_BWD_PREFETCH": p,
                           "norm.NORM_BWD_WARPS": w}
                          for s, p, w in itertools.product((0, 1), (0, 1), (8, 16))],
                 {"norm.MODULATE_BWD_SPLIT": 0, "norm.RMS_NORM_BWD_SPLIT": 1, "norm.NORM_BWD_PREFETCH": 1,
                  "norm.NORM_BWD_WARPS": 2}),
    "norm_finish": (("norm_modulate", "norm"),
                    lambda: _finish_shapes("norm.FINISH_BLOCK_P", "norm.FINISH_BLOCK_H", (16, 32, 64, 128, 256))
                    + _finish_rows(),
                    {"norm.FINISH_BLOCK_P": 4, "norm.FINISH_BLOCK_R": 2, "norm.FINISH_BLOCK_H": 16}),
    "norm_runs": (("norm_modulate", "norm"),
                  lambda: [{}] + _grid(**{"norm.NORM_BWD_RUNS": (1,), "norm.NORM_BWD_STAGES": (2, 3, 4)}),
                  {"norm.NORM_BWD_RUNS": 1, "norm.NORM_BWD_STAGES": 2}),
    "norm_fwd": (("norm_modulate", "norm"),
                 lambda: [{"norm.MODULATE_FWD_SPLIT": s, "norm.RMS_NORM_FWD_SPLIT": s, "norm.NORM_FWD_WARPS": w}
                          for s, w in itertools.product((0, 1), (4, 8, 16))],
                 {"norm.MODULATE_FWD_SPLIT": 0, "norm.RMS_NORM_FWD_SPLIT": 1, "norm.NORM_FWD_WARPS": 2}),
    "qk_norm_rope": (("qk",), _qk_grid,
                     {"qk_norm_rope.QK_FWD_ROWS": 16, "qk_norm_rope.QK_FWD_WARPS": 2, "qk_norm_rope.QK_BWD_ROWS": 16,
                      "qk_norm_rope.QK_BWD_WARPS": 2, "qk_norm_rope.QK_BWD_PROGRAMS": 3}),
    "gated_residual": (("gated",), _gated_grid,
                       {"residual.GATED_TILE_S": 8, "residual.GATED_BLOCK_H": 32, "residual.GATED_WARPS": 2,
                        "residual.GATED_CHUNKS": 3}),
    "qk_prefetch": (("qk",),
                    lambda: [{"qk_norm_rope.QK_BWD_PREFETCH": p, "qk_norm_rope.QK_BWD_ROWS": r,
                              "qk_norm_rope.QK_BWD_WARPS": w, "qk_norm_rope.QK_BWD_PROGRAMS": n}
                             for p, (r, w), n in itertools.product((0, 1), ((8, 2), (16, 4), (32, 8)),
                                                                   (528, 792, 1024))],
                    {"qk_norm_rope.QK_BWD_PREFETCH": 1, "qk_norm_rope.QK_BWD_ROWS": 16,
                     "qk_norm_rope.QK_BWD_WARPS": 2, "qk_norm_rope.QK_BWD_PROGRAMS": 3}),
    "seg_finish": (("gated", "qk", "adaln"),
                   lambda: _finish_shapes("modulation.FINISH_BLOCK_P", "modulation.FINISH_BLOCK_N", (16, 64, 256)),
                   {"modulation.FINISH_BLOCK_P": 4, "modulation.FINISH_BLOCK_N": 16}),
    "adaln_stages": (("adaln",),
                     lambda: _grid(**{"modulation.GEMV_STAGES": (1, 2, 3, 4), "modulation.GEMV_WARPS": (4, 8)}),
                     {"modulation.GEMV_STAGES": 3, "modulation.GEMV_WARPS": 2}),
}


def apply(setting: dict[str, Any]) -> dict[str, Any]:
    """Set the constants ("module.CONST" in h3kernels); returns the previous values."""
    old = {}
    for key, value in setting.items():
        module, name = key.split(".")
        mod = importlib.import_module(f"h3kernels.{module}")
        if not hasattr(mod, name):
            raise AttributeError(f"h3kernels.{module} has no constant {name}")
        old[key] = getattr(mod, name)
        setattr(mod, name, value)
    return old


def parse_setting(text: str) -> dict[str, int]:
    """'residual.GATED_WARPS=4,residual.GATED_CHUNKS=64' -> {"residual.GATED_WARPS": 4, ...} (integer values)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.count(".") != 1 or not value.lstrip("-").isdigit():
            raise ValueError(f"bad --setting item {item!r}: expected module.CONST=integer")
        out[key.strip()] = int(value)
    return out


def label(setting: dict[str, Any]) -> str:
    return " ".join(f"{k.split('.')[1].lower()}={v}" for k, v in setting.items()) or "defaults"


def measure(builders: dict[str, Any], names: tuple[str, ...], setting: dict[str, Any], device: torch.device,
            copy_GBps: float, flush: torch.Tensor | None, warmup: int, iters: int) -> list[dict[str, Any]]:
    """One record per op and direction of the group, under `setting`."""
    out = []
    old = apply(setting)
    try:
        for name in names:
            op = name
            try:
                case = builders[name]()
                op = case.name
                rel = kernel_suite._check_close(case, device)
                times = kernel_suite._fwd_bwd(case.cand, case.cand_grads, device, flush, warmup, iters)
                for direction, ms, nbytes in zip(("fwd", "bwd"), times, (case.fwd_bytes, case.bwd_bytes),
                                                 strict=True):
                    out.append({"op": op, "dir": direction, "setting": setting, "rel_l2_vs_bf16_torch": rel,
                                "ms": ms, "GBps": nbytes / ms / 1e6, "pct_copy": nbytes / ms / 1e6 / copy_GBps})
                del case
            except Exception as err:  # noqa: BLE001 (a setting that fails to compile must not end the sweep)
                traceback.print_exc()
                out.append({"op": op, "dir": "both", "setting": setting,
                            "error": f"{type(err).__name__}: {str(err)[:200]}"})
            block_bench.free(device)
    finally:
        apply(old)
    return out


def report(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Print the tables (best first per op and direction); return the BAD records."""
    ok = [r for r in records if "error" not in r]
    least = {}
    for r in ok:
        least[r["op"]] = min(least.get(r["op"], r["rel_l2_vs_bf16_torch"]), r["rel_l2_vs_bf16_torch"])
    bad = [r for r in records
           if "error" in r or r["rel_l2_vs_bf16_torch"] > SAME_MATH * least[r["op"]] + SAME_MATH_FLOOR]
    print(f"{'op':<18} {'dir':<4} {'ms':>7} {'% copy':>7}  setting")
    for op, direction in dict.fromkeys((r["op"], r["dir"]) for r in ok):
        for r in sorted((r for r in ok if r["op"] == op and r["dir"] == direction), key=lambda r: r["ms"]):
            print(f"{op:<18} {direction:<4} {r['ms']:>7.3f} {r['pct_copy']:>7.0%}  {label(r['setting'])}")
    for r in bad:
        print(f"BAD {r['op']} {r['dir']} {label(r['setting'])}: {r.get('error') or r['rel_l2_vs_bf16_torch']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(KNOBS), help=f"comma-separated groups of {sorted(KNOBS)}")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny widths, S=96")
    parser.add_argument("--json", type=Path, default=None, help="write every record here")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new settings after this")
    parser.add_argument("--setting", action="append", default=None,
                        help="module.CONST=value,... to time instead of the grids (repeatable; '' = the defaults)")
    args = parser.parse_args(argv)
    try:
        chosen = None if args.setting is None else [parse_setting(t) for t in args.setting]
    except ValueError as err:
        parser.error(str(err))
    groups = [g for g in args.ops.split(",") if g]
    unknown = sorted(set(groups) - set(KNOBS))
    if unknown:
        parser.error(f"unknown --ops {unknown}; choose from {sorted(KNOBS)}")
    device = block_bench.bench_device(args.smoke, "bench/knob_sweep.py")
    if device is None:
        return 0
    S = 96 if args.smoke else args.seqlen
    warmup, iters = (1, 2) if args.smoke else (kernel_suite.KERNEL_WARMUP, kernel_suite.KERNEL_ITERS)
    copy = kernel_suite.copy_bandwidth(device, kernel_suite.COPY_BYTES_SMOKE if args.smoke else 1 << 30)
    print(f"copy {copy['GBps']:.0f} GB/s", flush=True)
    flush = (torch.empty(kernel_suite.FLUSH_BYTES // 4, device=device, dtype=torch.float32)
             if device.type == "cuda" else None)
    builders = {b.__name__: b for b in kernel_suite.kernel_cases("tiny" if args.smoke else "block", S, device)}
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for group in groups:
        names, grid, smoke_setting = KNOBS[group]
        for setting in chosen if chosen is not None else [smoke_setting] if args.smoke else grid():
            if time.monotonic() - t0 > args.budget_s:
                print(f"skip {group} {label(setting)}: past the {args.budget_s:.0f} s budget", flush=True)
                continue
            for rec in measure(builders, names, setting, device, copy["GBps"], flush, warmup, iters):
                records.append(rec)
                print(f"{rec['dir']} {rec['op']} {label(setting)}: "
                      + (rec["error"] if "error" in rec else f"{rec['ms']:.3f} ms {rec['pct_copy']:.0%} of copy, "
                         f"rel-L2 {rec['rel_l2_vs_bf16_torch']:.1e}"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"S": S, "copy": copy, "records": records}, indent=1))
    print(f"\nS={S}, copy {copy['GBps']:.0f} GB/s; best first per op and direction")
    return 1 if report(records) else 0


if __name__ == "__main__":
    sys.exit(main())
