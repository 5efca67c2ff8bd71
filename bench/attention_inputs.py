"""Do the attention kernels run slower on a block's real q/k/v/dO than on randn inputs of the same shape?

    python bench/attention_inputs.py                    # preset `block`, S = 16384, on CUDA (about 1 minute)
    python bench/attention_inputs.py --smoke            # CPU, TRITON_INTERPRET=1, `tiny` at S=96: the capture only

bench/block_profile.py measured our dK/dV kernel at 35.8 ms inside the block against 30.7 ms in bench/attention.py
(randn inputs), while cuDNN's backward was only 4% slower there (H200, session 14). This bench captures the
block-0 attention node's q, k, v and the gradient reaching its output in one bound forward+backward
(`h3kernels.bind(..., strict=True)`, the bench/block.py block), then times the candidate and SDPA cuDNN on those
tensors and on randn tensors of the same shape and dtype, per kernel (bench/attention.py's timer). The table
comes last: if `captured` is as fast as `randn`, the in-block slowdown is not the data.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on CPU tensors

import torch  # noqa: E402

from bench import attention as attn_bench  # noqa: E402
from bench import block as block_bench  # noqa: E402


def capture(preset: str, S: int, device: torch.device) -> list[torch.Tensor]:
    """[q, k, v, do] ([1, S, NH, D] bf16) of the first attention call of one bound forward+backward of the block."""
    from h3kernels import attention as A
    from h3kernels import bind
    from tasks.golden import block_wrapper
    from tasks.providers import CPU_PROVIDERS, CUDA_PROVIDERS, activate

    block = block_bench.build_block(block_bench.block_config(preset)).to(device=device, dtype=torch.bfloat16)
    inputs = block_bench.block_inputs(preset, S, device)
    seen: list[torch.Tensor] = []
    fwd, bwd = A.attention_fwd, A.attention_bwd

    def fwd_spy(q, k, v, cfg):  # noqa: ANN001, ANN202 (the launcher's signature)
        if not seen:
            seen.extend(t.detach().clone() for t in (q, k, v))
        return fwd(q, k, v, cfg)

    def bwd_spy(do, *rest):  # noqa: ANN001, ANN202
        if len(seen) == 3:
            seen.append(do.detach().clone())
        return bwd(do, *rest)

    provider = CUDA_PROVIDERS["default"] if device.type == "cuda" else CPU_PROVIDERS["cpu-default"]
    A.attention_fwd, A.attention_bwd = fwd_spy, bwd_spy
    try:
        with activate(provider, str(device)):
            binding = bind(block_wrapper(block), strict=True)
            try:
                block_bench.run_once(block, inputs, torch.bfloat16)
            finally:
                binding.unbind()
    finally:
        A.attention_fwd, A.attention_bwd = fwd, bwd
    if len(seen) != 4:
        raise RuntimeError(f"captured {len(seen)} of q, k, v, dO: the attention node did not run forward+backward")
    q, k, v, do = seen
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do.contiguous()]


def randn_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator(device=tensors[0].device).manual_seed(0)
    out = [torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype) for t in tensors]
    return [*(t.requires_grad_() for t in out[:3]), out[3]]


def stats(t: torch.Tensor) -> str:
    x = t.detach().float()
    return f"rms {float(x.square().mean().sqrt()):.3g}, max|x| {float(x.abs().max()):.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny preset, S=96")
    parser.add_argument("--seqlen", type=int, default=None, help="default 16384 (smoke: 96)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (smoke: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (smoke: 1)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench/attention_inputs.py needs a CUDA device (or --smoke) and found none; nothing measured.")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    preset, S = ("tiny", args.seqlen or 96) if args.smoke else ("block", args.seqlen or 16384)
    warmup, iters = args.warmup or (1 if args.smoke else 5), args.iters or (1 if args.smoke else 20)
    captured = capture(preset, S, device)
    B, S, NH, D = captured[0].shape
    bench_args = argparse.Namespace(batch=B, heads=NH, head_dim=D)
    from h3kernels import attention as A

    providers = {"h3kernels": (lambda q, k, v: A.attention(q, k, v), True),
                 "sdpa-cudnn": (attn_bench._sdpa_backend("CUDNN_ATTENTION"), False)}
    table = A.resolve_config(D, captured[0].dtype)
    lines = [f"preset {preset}: q/k/v/dO [{B}, {S}, {NH}, {D}] {captured[0].dtype}; attention table {table}"]
    for name, t in zip(("q", "k", "v", "dO"), captured, strict=True):
        lines.append(f"captured {name}: {stats(t)}")
    if device.type != "cuda":  # --smoke: the capture ran; the timer is CUDA events
        print("\n".join([*lines, "", "timing needs CUDA: captured the four tensors only"]))
        return 0
    header = f"{'inputs':<9} {'provider':<11} {'fwd ms':>8} {'bwd ms':>8} {'dK/dV ms':>9} {'dQ ms':>8}"
    lines += ["", header, "-" * len(header)]
    for label, tensors in (("captured", captured), ("randn", randn_like(captured))):
        for name, (fn, per_kernel) in providers.items():
            row, _ = attn_bench._row(S, bench_args, fn, tensors, None, warmup, iters, per_kernel=per_kernel)
            split = row.split or ("-", "-")
            cells = [f"{x:.3f}" if isinstance(x, float) else x for x in (row.fwd_ms, row.bwd_ms, *split)]
            lines.append(f"{label:<9} {name:<11} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9} {cells[3]:>8}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
