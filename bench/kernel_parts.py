"""Where the modulated-norm and gated-residual backwards spend their time: each launch group timed alone.

    python bench/kernel_parts.py [--preset block] [--seqlen 16384] [--smoke]

`bench/kernel_suite.py` times each op's whole backward (rms_norm_modulate 5.15 ms, gated_residual 2.48 ms at
S=16384 on the H200, session 2). This splits them: norm.py's one backward kernel asked for dx only, for the
parameter partials (plus their finish) only, and for both, next to the plain norm's (the same bytes, one partial
row per chunk); gated_residual's d_table alone and with d_branch; on the real packed layout
(`bench.block.layout`), L2 flushed before each call. It also prints how many row chunks of that
layout are one table row (the fast path of gated_residual's segmented sums).
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
from bench.block import time_ms  # noqa: E402

FLUSH_BYTES = 256 << 20


def uniform_chunks(idx: torch.Tensor, num_rows: int) -> tuple[int, int]:
    """(chunks of one table row, all chunks) of gated_residual's backward plan for this index layout."""
    from h3kernels.residual import bwd_plan

    chunk, _, _, nc = bwd_plan(idx.numel(), num_rows)
    uniform = sum(1 for c in range(nc) if c * chunk + chunk <= idx.numel()
                  and idx[c * chunk:(c + 1) * chunk].unique().numel() == 1)
    return uniform, nc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="block")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny preset, S=96")
    args = parser.parse_args()
    preset, S = ("tiny", 96) if args.smoke else (args.preset, args.seqlen)
    device = block_bench.bench_device(args.smoke, "bench/kernel_parts.py")
    if device is None:
        return

    from h3kernels.modulation import MODALITY_NUM
    from h3kernels.norm import _rms_bwd, _rms_fwd
    from h3kernels.residual import _gated_bwd

    H = block_bench.block_config(preset)["hidden_size"]
    idx_cpu, _, _, T = block_bench.layout(preset, S)
    R = T * MODALITY_NUM
    idx = idx_cpu.to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * std).to(dtype)

    x, dy, branch = randn(S, H), randn(S, H), randn(S, H)
    weight, table = 1 + randn(H, std=0.02), randn(R, 6 * H, dtype=torch.float32, std=0.1)
    _, rstd = _rms_fwd(x, weight, table, idx, 0, H, 1e-5)
    _, rstd_plain = _rms_fwd(x, weight, None, None, 0, 0, 1e-5)
    flush = None if args.smoke else torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    iters = 2 if args.smoke else 20

    def t(fn) -> float:
        return time_ms(fn, device, 1 if args.smoke else 3, iters, flush)

    rows = [
        ("rms_norm_modulate bwd: dx only", t(lambda: _rms_bwd(dy, x, weight, table, idx, rstd, 0, H,
                                                                True, False, False))),
        ("rms_norm_modulate bwd: d_weight+d_table only", t(lambda: _rms_bwd(dy, x, weight, table, idx, rstd, 0, H,
                                                                              False, True, True))),
        ("rms_norm_modulate bwd: all", t(lambda: _rms_bwd(dy, x, weight, table, idx, rstd, 0, H, True, True, True))),
        ("rms_norm bwd: all",
         t(lambda: _rms_bwd(dy, x, weight, None, None, rstd_plain, 0, 0, True, True, False))),
        ("gated_residual bwd: d_table only", t(lambda: _gated_bwd(dy, branch, table, idx, 2 * H, False, True))),
        ("gated_residual bwd: d_branch+d_table", t(lambda: _gated_bwd(dy, branch, table, idx, 2 * H, True, True))),
    ]
    uniform, chunks = uniform_chunks(idx_cpu, R)
    print(f"{preset} S={S} H={H} R={R}: {uniform} of {chunks} row chunks are one table row")
    print(f"{'part':<44} {'ms':>8}")
    for name, ms in rows:
        print(f"{name:<44} {ms:>8.3f}")


if __name__ == "__main__":
    main()
