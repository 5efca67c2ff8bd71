"""Shared test machinery for the h3kernels ops: devices, the gpu shape marker, forward+backward runs, metrics.

Metrics follow STYLE (Tests): max abs, relative L2 error, the count of elementwise mismatches against the
tolerance table and the count of NaN/Inf, reported separately in every assertion message.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

import pytest
import torch

from h3kernels._common import poisoned_outputs
from tests.kernels.tolerances import lookup

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"))


@contextlib.contextmanager
def reproducible(device: torch.device | str):
    """Deterministic algorithms on CUDA, where diffusers' index_select backward otherwise scatter-adds with
    atomics (two identical runs differ in the last bits); a no-op on the CPU, which is reproducible as is."""
    if torch.device(device).type != "cuda":
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def real(*values, id: str):  # noqa: A002 - pytest's own keyword
    """A pytest param at the real H3 widths: gpu-marked, skipped cleanly without CUDA."""
    return pytest.param(*values, marks=GPU_MARKS, id=id)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape: int, g: torch.Generator, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0):
    """Random values made on the CPU (the same on every machine), then moved to the test device."""
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)


def randint(high: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=g).to(DEVICE)


def run(fn: Callable, args: Sequence, grad_of: Sequence[int], dy: torch.Tensor | None = None,
        cast: torch.dtype | None = None, poison: bool = False):
    """Forward + backward of fn(*args) with upstream gradient dy; returns (out, [grads in grad_of order]).

    Floating tensors are cloned (cast to `cast` when given, e.g. float64 for the ground truth); the ones at
    positions `grad_of` require grad. dy is cast to the output's dtype.
    """
    call = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().to(cast or a.dtype).clone().requires_grad_(i in grad_of)
        call.append(a)
    with poisoned_outputs() if poison else contextlib.nullcontext():
        out = fn(*call)
        grads = []
        if grad_of:
            d = dy if dy is not None else torch.ones_like(out)
            grads = list(torch.autograd.grad(out, [call[i] for i in grad_of], d.to(out.dtype)))
    return out.detach(), [g.detach() for g in grads]


def metrics(cand: torch.Tensor, truth: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> dict:
    c = cand.detach().double().cpu()
    t = truth.detach().double().cpu()
    nonfinite = int((~torch.isfinite(c)).sum())
    diff = (c - t).abs()
    rms = float(t.pow(2).mean().sqrt()) if t.numel() else 0.0
    bad = diff > atol * rms + rtol * t.abs()
    tn = float(t.norm())
    return {
        "max_abs": float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0,
        "rel_l2": float((c - t).norm()) / tn if tn > 0 else float((c - t).norm()),
        "mismatches": int(bad.sum() + torch.isnan(diff).sum()),
        "numel": t.numel(),
        "nonfinite": nonfinite,
    }


def describe(m: dict) -> str:
    return (f"max_abs={m['max_abs']:.3e} rel_l2={m['rel_l2']:.3e} mismatches={m['mismatches']}/{m['numel']} "
            f"nan/inf={m['nonfinite']}")


def assert_close(op: str, dtype: torch.dtype, what: str, cand: torch.Tensor, truth: torch.Tensor) -> dict:
    tol = lookup(op, dtype, what)
    assert cand.shape == truth.shape, f"{op} {what}: shape {list(cand.shape)} != {list(truth.shape)}"
    m = metrics(cand, truth, tol.atol, tol.rtol)
    assert m["nonfinite"] == 0 and m["mismatches"] == 0, (
        f"{op} {dtype} {what}: {describe(m)} (atol={tol.atol}*rms, rtol={tol.rtol}: {tol.reason})")
    return m


def assert_no_worse(op: str, dtype: torch.dtype, what: str, cand: torch.Tensor, ref: torch.Tensor,
                    truth: torch.Tensor) -> None:
    """The candidate is within the table's bound and at least `vs_ref` times as close to float64 as diffusers."""
    tol = lookup(op, dtype, what)
    mc = assert_close(op, dtype, what, cand, truth)
    mr = metrics(ref, truth)
    assert tol.vs_ref is not None, f"no vs_ref for {(op, dtype, what)}"
    assert mc["rel_l2"] <= tol.vs_ref * mr["rel_l2"], (
        f"{op} {dtype} {what}: candidate rel_l2 {mc['rel_l2']:.3e} > {tol.vs_ref} x reference {mr['rel_l2']:.3e} "
        f"(candidate {describe(mc)}; reference {describe(mr)}; {tol.reason})")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_deterministic(fn: Callable, args: Sequence, grad_of: Sequence[int], dy: torch.Tensor) -> None:
    out1, g1 = run(fn, args, grad_of, dy)
    out2, g2 = run(fn, args, grad_of, dy)
    assert same_bytes(out1, out2), "forward differs between two identical runs"
    for i, (a, b) in enumerate(zip(g1, g2, strict=True)):
        assert same_bytes(a, b), f"gradient of arg {grad_of[i]} differs between two identical runs"


def diffusers_block_capture(S: int = 24, H: int = 96, NH: int = 4, D: int = 32, F: int = 256, E: int = 48, T: int = 2,
                            seed: int = 0) -> dict:
    """Run a bf16 diffusers MiniMaxH3TransformerBlock (CPU) and capture what its sub-modules saw and produced.

    Returns the block, its inputs (hidden [S, H], temb, adaln idx, cos/sin) and, batch dim dropped: attn_in,
    attn_out, ff_in, ff_out, out, q_in (norm_q input [S, NH, D]), swiglu_proj (ff.net[0].proj output), swiglu_out.
    """
    diffusers_mt = pytest.importorskip("diffusers.models.transformers.transformer_minimax_h3")
    torch.manual_seed(seed)
    block = diffusers_mt.MiniMaxH3TransformerBlock(H, NH, D, F, E, norm_eps=1e-5, qk_norm_eps=1e-5)
    with torch.no_grad():
        for norm in (block.norm1, block.norm2, block.attn.norm_q, block.attn.norm_k):
            norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
        block.adaln_proj.linear.weight.mul_(4.0)  # modulation of order 0.3, as a trained model's
    block = block.to(torch.bfloat16)
    rope = diffusers_mt.MiniMaxH3RotaryPosEmbed(rope_freq_dim=4)
    cos, sin = rope(torch.randint(0, 16, (S, 3)))
    temb = torch.randn(T, E)  # fp32, as the checkpoint's time_embedder produces it
    idx = torch.randint(0, 3 * T, (S,))
    hidden = torch.randn(1, S, H).to(torch.bfloat16)
    cap: dict = {}

    def keep(name, output=True):
        def hook(mod, args, out):
            cap[name + "_in"] = args[0][0].detach()
            if output:
                cap[name + "_out"] = out[0].detach()
        return hook

    handles = [block.attn.register_forward_hook(keep("attn")), block.ff.register_forward_hook(keep("ff")),
               block.attn.norm_q.register_forward_hook(keep("q", output=False)),
               block.ff.net[0].proj.register_forward_hook(lambda m, a, o: cap.__setitem__("swiglu_proj", o[0])),
               block.ff.net[0].register_forward_hook(lambda m, a, o: cap.__setitem__("swiglu_out", o[0]))]
    with torch.no_grad():
        out = block(hidden, temb, idx, (cos, sin))
    for h in handles:
        h.remove()
    cap.update(block=block, hidden=hidden[0], temb=temb, idx=idx, cos=cos, sin=sin, out=out[0], module=diffusers_mt)
    return cap
