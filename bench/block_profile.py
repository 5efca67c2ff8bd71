"""Where one block's forward+backward spends its GPU time: diffusers' default BF16 provider vs the bound candidate.

    python bench/block_profile.py                      # preset `block`, S = 16384, on CUDA (about 1 minute)
    python bench/block_profile.py --seqlen 4096 --top 20
    python bench/block_profile.py --smoke              # CPU, TRITON_INTERPRET=1, `tiny` at S=96: every code path

bench/block.py says how long the two runs take; this says which kernels the difference is made of. The block,
its weights and inputs are bench/block.py's (`build_block`, `block_inputs`); the candidate is bound with
`h3kernels.bind(block_wrapper(block), strict=True)` under the same provider, as there.

Method: `--warmup` untimed passes, `--iters` passes timed with CUDA events (bench/block.py's `time_ms`: the median
pass), then torch.profiler (CUDA activity; CPU ops under --smoke) over `--iters` more. Each kernel's device time is
summed and divided by the passes, so the numbers are ms per pass. Event time minus kernel time is the time the device
sat idle in a pass: waiting for the host to launch (host-side work per op, a synchronising call). Kernels are
grouped by name into CATEGORIES; the table lists each category for both runs, the pass times, then the `--top`
kernels by the candidate's excess over the default. The table comes last.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on CPU tensors

import torch  # noqa: E402

from bench import block as block_bench  # noqa: E402

# (category, pattern searched in the kernel name, case-insensitive), first match wins. Triton kernels are named after
# their function, and every h3kernels one is `_..._kernel` (ATen's are `void at::native::..._kernel<...>`); cuBLAS
# GEMMs are `nvjet_*`, `sm90_xmma_gemm_*` or `cutlass*`; cuDNN and flash SDPA kernels carry `sdpa`, `fmha` or
# `flash`. Under --smoke the rows are CPU ops: ATen ops and h3kernels' autograd Functions (`_AttentionFn`, ...).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention (h3kernels)", r"^_attn_\w*_kernel$|^_attentionfn"),
    ("attention (SDPA)", r"sdpa|fmha|flash|attention"),
    ("GEMM (cuBLAS)", r"gemm|nvjet|cutlass|xmma|^aten::(addmm|mm|bmm|linear)$"),
    ("h3kernels (other)", r"^_\w+_kernel$|^_\w+$"),
    ("copies and casts", r"copy|cast|convert|contiguous|clone"),
    ("everything else (elementwise, reductions, index)", r""),
)


def category(name: str) -> str:
    return next(cat for cat, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE))


def profile_passes(block: torch.nn.Module, inputs: dict, device: torch.device, warmup: int,
                   iters: int) -> tuple[dict[str, float], float]:
    """({kernel name: ms per forward+backward pass} over `iters` profiled passes, the median pass in ms timed with
    CUDA events over `iters` unprofiled ones), after `warmup` untimed passes."""
    from torch.profiler import ProfilerActivity, profile

    grad = inputs["grad"].to(torch.bfloat16)

    def once() -> None:
        block.zero_grad(set_to_none=True)
        x, temb = block_bench._leaves(inputs, torch.bfloat16)
        block(x, temb, inputs["adaln_indices"], inputs["rotary_emb"]).backward(grad)

    pass_ms = block_bench.time_ms(once, device, warmup, iters)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            once()
        block_bench.sync(device)
    block.zero_grad(set_to_none=True)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for evt in prof.key_averages():
        if cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.key] += evt.self_device_time_total / 1e3 / iters
        elif not cuda and evt.self_cpu_time_total > 0 and evt.key.startswith(("aten::", "_")):
            per_kernel[evt.key] += evt.self_cpu_time_total / 1e3 / iters
    return dict(per_kernel), pass_ms


def profile_block(preset: str, S: int, device: torch.device, warmup: int,
                  iters: int) -> dict[str, tuple[dict[str, float], float]]:
    """{"default": ({kernel: ms}, pass ms), "candidate": (...)} for one block of `preset` at sequence length S."""
    from h3kernels import bind
    from tasks.golden import block_wrapper
    from tasks.providers import CPU_PROVIDERS, CUDA_PROVIDERS, activate

    dev = str(device)
    provider = CUDA_PROVIDERS["default"] if device.type == "cuda" else CPU_PROVIDERS["cpu-default"]
    block = block_bench.build_block(block_bench.block_config(preset)).to(device=device, dtype=torch.bfloat16)
    inputs = block_bench.block_inputs(preset, S, device)
    out: dict[str, tuple[dict[str, float], float]] = {}
    with activate(provider, dev):
        out["default"] = profile_passes(block, inputs, device, warmup, iters)
        binding = bind(block_wrapper(block), strict=True)
        try:
            out["candidate"] = profile_passes(block, inputs, device, warmup, iters)
            if binding.missing():
                raise RuntimeError(f"candidate nodes never ran: {binding.missing()}")
        finally:
            binding.unbind()
    return out


def by_category(per_kernel: dict[str, float]) -> dict[str, float]:
    sums = dict.fromkeys((cat for cat, _ in CATEGORIES), 0.0)
    for name, ms in per_kernel.items():
        sums[category(name)] += ms
    return sums


def rows(runs: dict[str, tuple[dict[str, float], float]], top: int) -> list[list[str]]:
    (default, pass_d), (cand, pass_c) = runs["default"], runs["candidate"]
    cat_d, cat_c = by_category(default), by_category(cand)
    out = [["category", cat, f"{cat_d[cat]:.3f}", f"{cat_c[cat]:.3f}", f"{cat_c[cat] - cat_d[cat]:+.3f}"]
           for cat in cat_d if cat_d[cat] or cat_c[cat]]
    total_d, total_c = sum(default.values()), sum(cand.values())
    out.append(["category", "total device time per pass", f"{total_d:.3f}", f"{total_c:.3f}",
                f"{total_c - total_d:+.3f} ({total_c / total_d:.3f}x)" if total_d else "-"])
    out.append(["pass", "fwd+bwd time per pass (median; CUDA events)", f"{pass_d:.3f}", f"{pass_c:.3f}",
                f"{pass_c - pass_d:+.3f} ({pass_c / pass_d:.3f}x)"])
    out.append(["pass", "device idle per pass (event time - kernel time)", f"{pass_d - total_d:.3f}",
                f"{pass_c - total_c:.3f}", f"{(pass_c - total_c) - (pass_d - total_d):+.3f}"])
    names = sorted(set(default) | set(cand), key=lambda n: -abs(cand.get(n, 0.0) - default.get(n, 0.0)))
    for name in names[:top]:
        d, c = default.get(name, 0.0), cand.get(name, 0.0)
        short = name if len(name) <= 90 else name[:87] + "..."
        out.append(["kernel", short, f"{d:.3f}", f"{c:.3f}", f"{c - d:+.3f}"])
    return out


HEADER = ("section", "what", "default ms/pass", "candidate ms/pass", "candidate - default")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny widths, S=96")
    parser.add_argument("--seqlen", type=int, default=None, help="default 16384 (smoke: 96)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (smoke: 1)")
    parser.add_argument("--iters", type=int, default=None, help="profiled passes; default 5 (smoke: 1)")
    parser.add_argument("--top", type=int, default=16, help="kernels listed, largest |difference| first")
    args = parser.parse_args(argv)
    device = block_bench.bench_device(args.smoke, "bench/block_profile.py")
    if device is None:
        return 0
    preset, S = ("tiny", args.seqlen or 96) if args.smoke else ("block", args.seqlen or 16384)
    info = block_bench.machine()
    print(block_bench.machine_line(info, f"preset {preset}, S={S}", "SMOKE (CPU interpreter)" if args.smoke else ""),
          flush=True)
    runs = profile_block(preset, S, device, args.warmup if args.warmup is not None else (1 if args.smoke else 3),
                         args.iters if args.iters is not None else (1 if args.smoke else 5))
    print(block_bench.table(rows(runs, args.top), HEADER))
    return 0


if __name__ == "__main__":
    sys.exit(main())
