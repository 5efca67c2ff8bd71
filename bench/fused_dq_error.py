"""How much error does the fused dQ's int32 fixed point add? dq of the separate dQ kernel vs dq_fused=1, against FP32.

    python bench/fused_dq_error.py                          # CUDA: randn and block 0's captured q/k/v/dO, S=16384
    python bench/fused_dq_error.py --seqlen 4096 --no-captured
    python bench/fused_dq_error.py --smoke                  # CPU, TRITON_INTERPRET=1: randn, S=96, 2 heads

h3kernels/attention.py ("Fused dQ") sums each key block's share of dq_i in units of bound_i / 2**30, with
bound_i = 2 |dO_i| max_j |v_j| max |k| per (batch, head), and claims the fixed point adds at most half a unit per
key block. How much that is next to bf16's own rounding depends on how far the bound overstates |dq_i|, which is a
property of the data. Per input kind this prints:
    rel-L2 to FP32 of dq, separate and fused (the FP32 reference: SDPA's math path on the bf16 inputs upcast, a few
        heads at a time), and of fused against separate;
    overstatement: median and max over rows of bound_i / (sqrt(D) |dq_i|_inf), the factor that turns the unit into
        a relative error (rows with dq_i = 0 left out);
    headroom used: max over rows of |dq_i|_inf sqrt(D) / bound_i * 2**30 / 2**31, the largest share of the int32
        range a row's sum can have reached (the design keeps it <= 1/2);
    whether o, dk and dv are byte-identical between the two (they must be).
The inputs are [1, S, NH, 128] bf16; `captured` is bench/attention_inputs.py's capture of the `block` preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on CPU tensors

import torch  # noqa: E402

HEADS_PER_REFERENCE_CHUNK = 4  # FP32 reference heads at a time: S x S x 4 bytes each (1 GiB per head at 16384)


def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, cfg: object) -> list[torch.Tensor]:
    from h3kernels import attention as A

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = A.attention(*leaves, config=cfg)
    return [o.detach(), *torch.autograd.grad(o, leaves, do)]


def _fp32_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    from h3kernels import attention as A

    parts = []
    for h0 in range(0, q.shape[2], HEADS_PER_REFERENCE_CHUNK):
        sl = [t[:, :, h0:h0 + HEADS_PER_REFERENCE_CHUNK].float().detach().requires_grad_() for t in (q, k, v)]
        o = A.attention_reference(*sl)
        parts.append(torch.autograd.grad(o, sl[0], do[:, :, h0:h0 + HEADS_PER_REFERENCE_CHUNK].float())[0])
    return torch.cat(parts, dim=2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> dict[str, float | bool]:
    """The numbers of one input kind (see the module docstring)."""
    from h3kernels import attention as A

    D = q.shape[-1]
    table = A.resolve_config(D, torch.bfloat16)
    separate = _grads(q, k, v, do, dataclasses.replace(table, dq_fused=0))
    fused = _grads(q, k, v, do, dataclasses.replace(table, dq_fused=1))
    truth = _fp32_dq(q, k, v, do)
    bound = 2 * torch.linalg.vector_norm(do.float(), dim=-1) * A._max_norm_products(k, v)[:, None, :]
    row_max = truth.abs().amax(dim=-1) * D**0.5
    live = row_max > 0
    over = (bound[live] / row_max[live]).double()
    return {
        "rel_separate": _rel(separate[1], truth), "rel_fused": _rel(fused[1], truth),
        "rel_fused_vs_separate": _rel(fused[1], separate[1]),
        "overstatement_median": float(over.median()), "overstatement_max": float(over.max()),
        "headroom_used": float((row_max[live] / bound[live]).max()) * A.DQ_FIX_ONE / 2**31,
        "o_dk_dv_identical": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                 for a, b in zip([separate[0], *separate[2:]], [fused[0], *fused[2:]], strict=True)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, randn at S=96, 2 heads")
    parser.add_argument("--seqlen", type=int, default=None, help="default 16384 (smoke: 96)")
    parser.add_argument("--heads", type=int, default=None, help="default 56 (smoke: 2)")
    parser.add_argument("--no-captured", action="store_true", help="randn inputs only")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    S, heads = args.seqlen or (96 if args.smoke else 16384), args.heads or (2 if args.smoke else 56)
    g = torch.Generator(device=device).manual_seed(0)
    kinds = {"randn": [torch.randn((1, S, heads, 128), generator=g, device=device, dtype=torch.bfloat16)
                       for _ in range(4)]}
    if not (args.smoke or args.no_captured):
        from bench import attention_inputs

        kinds["captured"] = attention_inputs.capture("block", S, device)
    print(f"{'inputs':<9} {'rel sep':>9} {'rel fused':>9} {'fused-sep':>9} {'over med':>9} {'over max':>9} "
          f"{'headroom':>9} o/dk/dv identical   (S={S}, {heads} heads x 128, bf16)")
    ok = True
    for name, tensors in kinds.items():
        r = measure(*tensors)
        ok = ok and bool(r["o_dk_dv_identical"]) and r["headroom_used"] <= 0.5
        print(f"{name:<9} {r['rel_separate']:9.3e} {r['rel_fused']:9.3e} {r['rel_fused_vs_separate']:9.3e} "
              f"{r['overstatement_median']:9.3g} {r['overstatement_max']:9.3g} {r['headroom_used']:9.3g} "
              f"{'yes' if r['o_dk_dv_identical'] else 'NO'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
