"""Candidate mutants: realistic kernel bugs, each applied to one node of one block through the binding's overrides.

A ``Mutant`` names the node and block it replaces (``bind(..., overrides={(block, node): factory()})``), what
the bug is, whether the gate must catch it (``must_catch``), and where its first drift should land
(``expect_block``, default its own block). ``library(config)`` returns the mutants for a model config (block
names depend on ``num_layers``). No file is edited: a mutant exists only as an override of one bound node.

Every op here is plain torch with the node signatures of ``h3kernels.nodes`` (fp32 math, cast back to the
activation dtype; AdaLN tables are fp32 like the candidate's). ``honest_ops()`` is the same code without a
bug: a correct alternative with a different arithmetic order than the reference (fp32 accumulation where
diffusers accumulates in bf16, softmax upcast, fused fp32 modulate, fp32 cos/sin), used as a false-reject
probe. A mutant is that honest op with one thing wrong, so a caught mutant is caught for its bug alone.

Sizes: the structural bugs (no ``1 +``, gate on the residual, dropped bias, transposed heads, wrong rotary)
are large; softmax scale, RMSNorm eps, the bf16 accumulator and the perturbed backward are sized so that
their error at the node is a few BF16 roundings (subtle). ``must_catch`` is True only where the bug changes
the computation by clearly more than BF16 rounding: eps moved outside the sqrt changes a unit-RMS row by
~eps/2 = 5e-6 (a thousandth of bf16 roundoff) and is kept as an expected escape, a record of what the gate
cannot see, not a failure of it.

Adding a mutant: write an op with the node's signature (start from the honest op of that node), append a
``Mutant`` to ``library``; the self-test picks it up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from h3kernels.nodes import BLOCK_NODES, CANDIDATE_OPS

Op = Callable[..., Any]
MODALITY_NUM = 3  # AdaLN table rows per timestep: video 0, text 1, audio 2 (diffusers' token tags)
AUDIO_TAG = 2


@dataclass(frozen=True)
class Mutant:
    """One bug in one node of one block."""

    name: str
    node: str
    block: str
    description: str
    must_catch: bool
    factory: Callable[[], Op]
    expect_block: str | None = None  # where first drift should land; None: `block`

    def overrides(self) -> dict[tuple[str, str], Op]:
        return {(self.block, self.node): self.factory()}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "node": self.node, "block": self.block, "description": self.description,
                "must_catch": self.must_catch, "expect_block": self.expect_block or self.block}


# ------------------------------------------------------------------------------------------------ honest ops


def _rows(table: torch.Tensor, H: int, chunk: int, idx: torch.Tensor) -> torch.Tensor:
    # fp32 chunk of the table, gathered per row (the candidate's table is fp32 already; a bf16 one is upcast).
    return table.float()[:, chunk * H:(chunk + 1) * H].index_select(0, idx)


def adaln_proj(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, use_bias: bool = True,
               ) -> torch.Tensor:
    """fp32 silu and GEMV; the table stays fp32 [3T, 6H] (as the candidate's).

    ``use_bias=False`` is the bug of a forward that drops the bias while its backward still computes d_bias
    (``b - b.detach()``: zero in the forward, the right gradient in the backward)."""
    b = bias.float() if use_bias else bias.float() - bias.float().detach()
    table = F.linear(F.silu(temb.float()), weight.float(), b)
    return table.view(-1, weight.shape[0] // MODALITY_NUM)


def norm_modulate(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, shift_chunk: int,
                  scale_chunk: int, eps: float, *, eps_outside: bool = False, one_plus: bool = True,
                  row_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """RMSNorm and modulate fused in fp32: ``norm(x) * (1 + scale) + shift``, one rounding at the end."""
    H, xf = x.shape[-1], x.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    inv = 1.0 / (ms.sqrt() + eps) if eps_outside else torch.rsqrt(ms + eps)
    idx = idx if row_fn is None else row_fn(idx)
    scale, shift = _rows(table, H, scale_chunk, idx), _rows(table, H, shift_chunk, idx)
    y = xf * inv * weight.float()
    return (y * ((1.0 + scale) if one_plus else scale) + shift).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 GEMM (fp32 inputs, fp32 accumulation), rounded once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def linear_bf16_acc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_k: int = 32,
                    ) -> torch.Tensor:
    """The bug: a K-loop whose accumulator is bf16 (each BLOCK_K partial product exact, the running sum rounded)."""
    acc = None
    for k0 in range(0, x.shape[-1], block_k):
        part = F.linear(x[:, k0:k0 + block_k].float(), weight[:, k0:k0 + block_k].float())
        acc = (part if acc is None else acc.float() + part).to(torch.bfloat16)
    out = acc.float() + (0.0 if bias is None else bias.float())
    return out.to(x.dtype)


def qkv(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return linear(x, wq, None), linear(x, wk, None), linear(x, wv, None)


def _norm_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float,
               wrong_channels: bool, swapped_sign: bool) -> torch.Tensor:
    D = x.shape[-1]
    y = F.rms_norm(x.float(), (D,), w.float(), eps)
    if cos is None:
        return y.to(x.dtype)
    rd = cos.shape[-1]
    # The rotary channels are the first rd of each head; the bug rotates the last rd instead.
    keep, rot = (y[..., :D - rd], y[..., D - rd:]) if wrong_channels else (y[..., rd:], y[..., :rd])
    x1, x2 = rot.chunk(2, dim=-1)
    turned = torch.cat((x2, -x1) if swapped_sign else (-x2, x1), dim=-1)
    # cos/sin stay fp32 (the rope buffer's dtype), as the candidate keeps them.
    rot = rot * cos.float()[:, None, :] + turned * sin.float()[:, None, :]
    out = torch.cat((keep, rot) if wrong_channels else (rot, keep), dim=-1)
    return out.to(x.dtype).contiguous()


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, eps_q: float, eps_k: float, *, wrong_channels: bool = False,
                 swapped_sign: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then rotary, fp32 throughout."""
    return (_norm_rope(q, wq, cos, sin, eps_q, wrong_channels, swapped_sign),
            _norm_rope(k, wk, cos, sin, eps_k, wrong_channels, swapped_sign))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object, parallel_config: object, *,
              scale_factor: float = 1.0, transposed_heads: bool = False) -> torch.Tensor:
    """Softmax attention with scores, softmax and P @ V in fp32 (softmax upcast); [S, NH, D] in and out."""
    S, NH, D = q.shape
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [NH, S, D]
    p = torch.softmax((qf @ kf.transpose(-1, -2)) * (scale_factor / math.sqrt(D)), dim=-1)
    o = (p @ vf).transpose(0, 1)  # [S, NH, D]
    if transposed_heads:  # the bug: the output written [S, D, NH] and read back as [S, NH, D]
        o = o.transpose(1, 2).reshape(S, NH, D)
    return o.to(q.dtype).contiguous()


def gated_residual(x: torch.Tensor, branch: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, gate_chunk: int,
                   *, gate_on_residual: bool = False) -> torch.Tensor:
    """``x + gate * branch`` in fp32, rounded once."""
    gate = _rows(table, x.shape[-1], gate_chunk, idx)
    xf, bf = x.float(), branch.float()
    return (gate * xf + bf if gate_on_residual else xf + gate * bf).to(x.dtype)


def swiglu(proj: torch.Tensor) -> torch.Tensor:
    h, g = proj.float().chunk(2, dim=-1)
    return (h * F.silu(g)).to(proj.dtype)


HONEST_BLOCK_OPS: dict[str, Op] = {
    "adaln_proj": adaln_proj, "norm1_modulate": norm_modulate, "qkv": qkv, "qk_norm_rope": qk_norm_rope,
    "attention": attention, "to_out": linear, "gate_residual_attn": gated_residual, "norm2_modulate": norm_modulate,
    "ff_in": linear, "swiglu": swiglu, "ff_out": linear, "gate_residual_ff": gated_residual,
}
assert set(HONEST_BLOCK_OPS) == set(BLOCK_NODES)


def honest_ops(blocks: list[str]) -> dict[tuple[str, str], Op]:
    """Overrides binding the honest fp32 alternative to every node of each of `blocks`."""
    return {(block, node): op for block in blocks for node, op in HONEST_BLOCK_OPS.items()}


# ------------------------------------------------------------------------------------------------ backward bug


class _PerturbedSwiGLUBackward(torch.autograd.Function):
    """Forward: the candidate SwiGLU, untouched. Backward: the right gradient, with the gate half scaled by
    (1 + delta) (as a kernel that evaluates silu' with a slightly wrong constant would)."""

    @staticmethod
    def forward(ctx: Any, proj: torch.Tensor, delta: float) -> torch.Tensor:
        ctx.save_for_backward(proj)
        ctx.delta = delta
        return CANDIDATE_OPS["swiglu"](proj)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (proj,) = ctx.saved_tensors
        with torch.enable_grad():
            p = proj.detach().float().requires_grad_(True)
            h, g = p.chunk(2, dim=-1)
            (d,) = torch.autograd.grad(h * F.silu(g), p, grad.float())
        half = d.shape[-1] // 2
        d = torch.cat((d[..., :half], d[..., half:] * (1.0 + ctx.delta)), dim=-1)
        return d.to(proj.dtype), None


def swiglu_bad_backward(delta: float) -> Op:
    return lambda proj: _PerturbedSwiGLUBackward.apply(proj, delta)


# ------------------------------------------------------------------------------------------------ the library


def _one_modality_off_by_one(tag: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of modality `tag` read the table row one below their own (the neighbouring modality's)."""
    return lambda idx: torch.where(idx % MODALITY_NUM == tag, idx - 1, idx)


def _with_eps(eps: float, **kw: Any) -> Op:
    return lambda x, w, t, i, sh, sc, _eps: norm_modulate(x, w, t, i, sh, sc, eps, **kw)


def library(config: Mapping[str, Any]) -> tuple[Mutant, ...]:
    """The mutant library for a model config (blocks: the second and the last transformer block, block 0)."""
    n = int(config["num_layers"])
    mid, last, first = f"transformer_blocks.{min(1, n - 1)}", f"transformer_blocks.{n - 1}", "transformer_blocks.0"
    return (
        Mutant("softmax-scale", "attention", mid, "softmax scale 1.05/sqrt(D) instead of 1/sqrt(D)", True,
               lambda: lambda q, k, v, b, p: attention(q, k, v, b, p, scale_factor=1.05)),
        Mutant("rmsnorm-eps", "norm1_modulate", mid, "RMSNorm eps 1e-1 instead of the module's 1e-5 (a typo'd config)",
               True, lambda: _with_eps(1e-1)),
        Mutant("rmsnorm-eps-outside-sqrt", "norm2_modulate", mid, "x / (sqrt(mean x^2) + eps): eps outside the sqrt",
               False, lambda: lambda x, w, t, i, sh, sc, eps: norm_modulate(x, w, t, i, sh, sc, eps,
                                                                             eps_outside=True)),
        Mutant("bf16-accumulator", "ff_out", mid, "ff_out GEMM whose K-loop accumulator is bf16 (BLOCK_K=32)", False,
               lambda: linear_bf16_acc),
        Mutant("rope-wrong-channels", "qk_norm_rope", mid, "rotary applied to the last rd channels of each head", True,
               lambda: lambda *a: qk_norm_rope(*a, wrong_channels=True)),
        Mutant("rope-swapped-sign", "qk_norm_rope", last, "rotate_half with the sign swapped: (x2, -x1)", True,
               lambda: lambda *a: qk_norm_rope(*a, swapped_sign=True)),
        Mutant("modulate-no-one-plus", "norm2_modulate", mid, "modulate as norm(x) * scale + shift (no 1 +)", True,
               lambda: lambda *a: norm_modulate(*a, one_plus=False)),
        Mutant("gate-on-residual", "gate_residual_attn", last, "gate * residual + branch instead of x + gate * branch",
               True, lambda: lambda *a: gated_residual(*a, gate_on_residual=True)),
        Mutant("adaln-dropped-bias", "adaln_proj", first, "AdaLN projection forward without its bias (backward right)",
               True, lambda: lambda temb, w, b: adaln_proj(temb, w, b, use_bias=False)),
        Mutant("transposed-heads", "attention", first, "attention output written [S, D, NH], read as [S, NH, D]",
               True, lambda: lambda *a: attention(*a, transposed_heads=True)),
        Mutant("adaln-row-off-by-one", "norm1_modulate", last, "audio rows read the AdaLN row of index - 1 (text's)",
               True, lambda: lambda *a: norm_modulate(*a, row_fn=_one_modality_off_by_one(AUDIO_TAG))),
        Mutant("swiglu-backward", "swiglu", mid, "forward exact; backward scales the gate half's gradient by 1.05",
               True, lambda: swiglu_bad_backward(0.05)),
    )


def select(config: Mapping[str, Any], names: list[str] | None) -> list[Mutant]:
    """The named mutants of the library (all when ``names`` is empty); ValueError naming any unknown one."""
    available = library(config)
    unknown = sorted(set(names or ()) - {m.name for m in available})
    if unknown:
        raise ValueError(f"unknown mutants {unknown}; known: {[m.name for m in available]}")
    return [m for m in available if not names or m.name in names]


__all__ = ["HONEST_BLOCK_OPS", "Mutant", "honest_ops", "library", "select"]
