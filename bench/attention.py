"""Benchmark h3kernels.attention against torch SDPA (flash and cuDNN backends), forward and backward, bf16.

    python bench/attention.py                               # S = 4096, 16384, 32768; 56 heads x 128; B = 1
    python bench/attention.py --seqlens 16384 --config "fwd_n=128" --config "fwd_warps=4,fwd_stages=2"

Each --config is a set of AttnConfig field overrides (see h3kernels/attention.py) and gets its own row, so one run
compares tunings; without --config the table entry (plus $H3KERNELS_ATTN_CONFIG) runs. Layout [B, S, NH, D] as
diffusers passes it; SDPA gets the same tensors as [B, NH, S, D] transposed views, as diffusers' native backend does.

FLOPs (non-causal): forward 4 * B * NH * S^2 * D (QK^T and PV); backward 2.5x forward (five S x S x D matmuls, the
FlashAttention-2 convention). Times are medians of per-iteration torch.cuda.Event pairs after warmup; the backward is
torch.autograd.grad over a retained graph, so it excludes the forward. The last column is the largest |difference|
from the flash backend's o / dq / dk / dv: a tuning that breaks results shows there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout


def _time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _sdpa(backend: object) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            o_BNSD = torch.nn.functional.scaled_dot_product_attention(
                q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2))
        return o_BNSD.transpose(1, 2)

    return run


def _measure(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             warmup: int, iters: int) -> tuple[float, float, list[torch.Tensor]]:
    fwd_ms = _time_ms(lambda: fn(q, k, v), warmup, iters)
    o = fn(q, k, v)
    bwd_ms = _time_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup, iters)
    results = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
    return fwd_ms, bwd_ms, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--config", action="append", default=None, help="AttnConfig overrides, e.g. fwd_m=64,fwd_n=64")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA device and found none; nothing measured.")
        return 0

    import triton
    from torch.nn.attention import SDPBackend

    from h3kernels import attention as A

    dtype, D = torch.bfloat16, args.head_dim
    configs = {f"h3kernels[{spec}]": A.resolve_config(D, dtype, spec) for spec in args.config or []}
    configs = configs or {"h3kernels": A.resolve_config(D, dtype)}
    providers: dict[str, Callable[..., torch.Tensor]] = {
        name: (lambda c: lambda q, k, v: A.attention(q, k, v, config=c))(cfg) for name, cfg in configs.items()}
    providers["sdpa-flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    providers["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16 "
          f"B={args.batch} NH={args.heads} D={D} | warmup {args.warmup}, median of {args.iters}")
    for name, cfg in configs.items():
        print(f"{name}: {cfg}")
    width = max(len(n) for n in providers)
    print(f"{'S':>6}  {'provider':<{width}}  {'fwd ms':>8}  {'fwd TFLOP/s':>11}  {'bwd ms':>8}  {'bwd TFLOP/s':>11}  "
          "max|diff| vs flash (o dq dk dv)")
    for S in args.seqlens:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (args.batch, S, args.heads, D)
        q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
        do = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
        fwd_flop = 4.0 * args.batch * args.heads * S * S * D
        rows, ref = [], None
        for name in sorted(providers, key=lambda n: n != "sdpa-flash"):  # flash first: it is the diff reference
            try:
                fwd_ms, bwd_ms, res = _measure(providers[name], q, k, v, do, args.warmup, args.iters)
            except RuntimeError as err:  # a backend this torch build or GPU lacks
                rows.append((name, f"n/a: {str(err).splitlines()[0][:60]}"))
                continue
            ref = res if name == "sdpa-flash" else ref
            pairs = zip(res, ref or res, strict=True)
            diff = " ".join(f"{float((a.float() - b.float()).abs().max()):.1e}" for a, b in pairs)
            rows.append((name, f"{fwd_ms:8.3f}  {fwd_flop / fwd_ms / 1e9:11.1f}  {bwd_ms:8.3f}  "
                               f"{2.5 * fwd_flop / bwd_ms / 1e9:11.1f}  {diff if ref else 'n/a'}"))
            del res
        order = {n: i for i, n in enumerate(providers)}
        for name, text in sorted(rows, key=lambda r: order[r[0]]):
            print(f"{S:>6}  {name:<{width}}  {text}")
        del q, k, v, do, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
