"""adaln_table's GEMV tiles: forward and backward time of each (BLOCK_C, BLOCK_E, warps), against torch.

    python bench/adaln_tiles.py                          # the TILES below, on CUDA, `block` widths, T = 2
    python bench/adaln_tiles.py --tiles 16x256x8 32x128x4
    python bench/adaln_tiles.py --smoke                  # CPU, TRITON_INTERPRET=1, `tiny` widths: every code path

The case is bench/kernel_suite.py's adaln_table case (weight [18H, E] bf16, temb fp32, a 256 MiB buffer zeroed
before each timed call so nothing is served from L2), timed with its `_fwd_bwd`. Each tile sets
h3kernels.modulation's GEMV_BLOCK_C, GEMV_BLOCK_E and GEMV_WARPS, which the forward and the d_temb kernel share,
then checks the result against the bf16 torch baseline (kernel_suite's `_check_close`) and times it. Bandwidth is
kernel_suite's fewest-bytes count over the median time, as a share of a copy measured here. The table comes last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from bench import block as block_bench  # noqa: E402
from bench import kernel_suite as suite  # noqa: E402

# (BLOCK_C, BLOCK_E, warps): spill-free for sm_90 at BLOCK_T 2 and 4 (tests/kernels/test_compile.py's compile, run
# by hand over these); the first is the table's.
TILES = ("16x256x8", "16x256x4", "16x128x4", "8x256x4", "8x512x4", "32x128x4", "32x256x8", "64x64x8")


def parse_tile(text: str) -> tuple[int, int, int]:
    try:
        c, e, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {text!r} is not CxExW, e.g. 16x256x8") from None
    if min(c, e) < 1 or c & (c - 1) or e & (e - 1) or w not in (1, 2, 4, 8, 16):
        raise argparse.ArgumentTypeError(f"tile {text!r}: C and E must be powers of two, W in 1..16")
    return c, e, w


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny widths")
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=None, help="CxExW each (default TILES)")
    args = parser.parse_args(argv)
    device = block_bench.bench_device(args.smoke, "bench/adaln_tiles.py")
    if device is None:
        return 0
    from h3kernels import modulation as M

    tiles = args.tiles or [parse_tile(t) for t in (("128x128x4",) if args.smoke else TILES)]
    preset, S = ("tiny", 96) if args.smoke else ("block", 16384)
    warmup, iters = (1, 2) if args.smoke else (3, 20)
    flush = torch.empty(suite.FLUSH_BYTES // 4, device=device) if device.type == "cuda" else None
    copy = suite.copy_bandwidth(device, suite.COPY_BYTES_SMOKE if args.smoke else suite.COPY_BYTES)["GBps"]
    build = next(b for b in suite.kernel_cases(preset, S, device) if b.__name__ == "adaln")
    case = build()
    rows = []
    fwd, bwd = suite._fwd_bwd(case.base, case.base_grads, device, flush, warmup, iters)
    rows.append(["torch (bf16, diffusers' ops)", f"{fwd:.3f}", f"{case.fwd_bytes / fwd / 1e6 / copy:.0%}",
                 f"{bwd:.3f}", f"{case.bwd_bytes / bwd / 1e6 / copy:.0%}", "-"])
    table = (M.GEMV_BLOCK_C, M.GEMV_BLOCK_E, M.GEMV_WARPS)
    try:
        for c, e, w in tiles:
            M.GEMV_BLOCK_C, M.GEMV_BLOCK_E, M.GEMV_WARPS = c, e, w
            diff = suite._check_close(case, device)
            fwd, bwd = suite._fwd_bwd(case.cand, case.cand_grads, device, flush, warmup, iters)
            rows.append([f"h3kernels {c}x{e}x{w}" + (" (table)" if (c, e, w) == table else ""), f"{fwd:.3f}",
                         f"{case.fwd_bytes / fwd / 1e6 / copy:.0%}", f"{bwd:.3f}",
                         f"{case.bwd_bytes / bwd / 1e6 / copy:.0%}", f"{diff:.1e}"])
            print(" ".join(rows[-1]), flush=True)
    finally:
        M.GEMV_BLOCK_C, M.GEMV_BLOCK_E, M.GEMV_WARPS = table
    info = block_bench.machine()
    print(block_bench.machine_line(info, f"preset {preset}, copy {copy:.0f} GB/s"))
    print(block_bench.table(rows, ("adaln_table", "fwd ms", "fwd % copy", "bwd ms", "bwd % copy",
                                   "rel-L2 vs bf16 torch")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
