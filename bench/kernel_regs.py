"""Registers and spills of h3kernels' row-wise kernels as the GPU's JIT compiled them at the real width.

    python bench/kernel_regs.py [--seqlen 16384]     # on the GPU: a few seconds after the compiles

Runs each bench/kernel_suite.py case (bf16, preset `block`) forward and backward once, then prints, for every
compiled variant of every Triton kernel in norm, modulation, qk_norm_rope, residual and swiglu: warps, registers per
thread, spilled bytes, and the programs per SM that registers allow. This is the ground truth that
tests/kernels/test_compile.py approximates on the CPU (same specialization, maybe another triton).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

import torch  # noqa: E402
import triton  # noqa: E402

from bench import kernel_suite  # noqa: E402

REGISTERS_PER_SM = 65536


def compiled_variants() -> list[tuple[str, int, int, int]]:
    """(kernel name, warps, registers, spill bytes) of every compiled variant of the row-wise kernels."""
    from h3kernels import modulation, norm, qk_norm_rope, residual, swiglu

    rows = []
    for mod in (modulation, norm, qk_norm_rope, residual, swiglu):
        for name in sorted(vars(mod)):
            fn = getattr(mod, name)
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    rows.append((f"{mod.__name__.split('.')[-1]}.{name}", kernel.metadata.num_warps, kernel.n_regs,
                                 kernel.n_spills))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384, help="S of the cases (a bench/block.py layout)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    for build in kernel_suite.kernel_cases("block", args.seqlen, device):
        case = build()
        out = case.cand()
        torch.autograd.grad(out, case.cand_grads, torch.ones_like(out))
        del case, out
    torch.cuda.synchronize()
    print(f"{'kernel':44} {'warps':>5} {'regs':>5} {'spill B':>7} {'per SM':>6}")
    for name, warps, regs, spills in compiled_variants():
        per_sm = REGISTERS_PER_SM // max(1, ((regs + 7) // 8 * 8) * 32 * warps)
        print(f"{name:44} {warps:5d} {regs:5d} {spills:7d} {per_sm:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
