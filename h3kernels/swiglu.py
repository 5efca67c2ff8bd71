"""SwiGLU activation of the feed-forward (diffusers `activations.SwiGLU` after its projection).

Legend: S packed-sequence rows, F ffn dim (the projection is [S, 2F]).

swiglu(proj_SF2) -> out_SF
    out = h * silu(g), h = proj[:, :F], g = proj[:, F:]; fp32 math, one rounding to proj's dtype (diffusers
    rounds silu(g) to bf16 before the product). proj float32 or bfloat16, [S, 2F] contiguous.
    Backward: d_proj [S, 2F] in proj's dtype: d_h = dy * silu(g), d_g = dy * h * silu'(g),
    silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))), fp32 math, one rounding each.

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16, a
projection that is not 2-D with an even last dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels._common import (
    KernelInputError,
    cast_rne,
    check_inputs,
    check_shape,
    is_interpreting,
    new_empty,
    sigmoid_f32,
)

# 4096 output values per program (32 per thread at 4 warps); 1024 columns keep row segments coalesced
# (F=14336 is 14 column blocks). The interpreter takes 4x larger tiles: fewer Python-level programs.
TILE = 16384 if is_interpreting() else 4096
MAX_BLOCK_F = 1024


@triton.jit
def _swiglu_fwd_kernel(p_ptr, y_ptr, S, F, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m2 = (rows < S)[:, None] & (cols < F)[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    # Upcast at load: silu and the product in fp32 (no bf16 arithmetic; diffusers rounds silu(g) first).
    h = tl.load(p_ptr + base, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(p_ptr + base + F, mask=m2, other=0.0).to(tl.float32)
    y = h * (g * sigmoid_f32(g))
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, p_ptr, dp_ptr, S, F, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m2 = (rows < S)[:, None] & (cols < F)[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    h = tl.load(p_ptr + base, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(p_ptr + base + F, mask=m2, other=0.0).to(tl.float32)
    sg = sigmoid_f32(g)
    dh = dy * (g * sg)
    dg = dy * h * (sg * (1.0 + g * (1.0 - sg)))
    tl.store(dp_ptr + base, cast_rne(dh, dp_ptr.dtype.element_ty), mask=m2)
    tl.store(dp_ptr + base + F, cast_rne(dg, dp_ptr.dtype.element_ty), mask=m2)


def _plan(S: int, F: int) -> tuple[int, int, tuple[int, int]]:
    block_f = min(triton.next_power_of_2(F), MAX_BLOCK_F)
    block_s = max(1, TILE // block_f)
    return block_s, block_f, (triton.cdiv(S, block_s), triton.cdiv(F, block_f))


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, proj):
        S, F2 = proj.shape
        F = F2 // 2
        out = new_empty((S, F), proj.dtype, proj.device)
        block_s, block_f, grid = _plan(S, F)
        _swiglu_fwd_kernel[grid](proj, out, S, F, BLOCK_S=block_s, BLOCK_F=block_f, num_warps=4)
        ctx.save_for_backward(proj)
        return out

    @staticmethod
    def backward(ctx, dy):
        (proj,) = ctx.saved_tensors
        S, F2 = proj.shape
        d_proj = new_empty((S, F2), proj.dtype, proj.device)
        block_s, block_f, grid = _plan(S, F2 // 2)
        _swiglu_bwd_kernel[grid](dy.contiguous(), proj, d_proj, S, F2 // 2, BLOCK_S=block_s, BLOCK_F=block_f,
                                 num_warps=4)
        return d_proj


def swiglu(proj_SF2: torch.Tensor) -> torch.Tensor:
    """h * silu(g) of a [S, 2F] projection (h first half, g second), fp32 math, one rounding."""
    op = "swiglu"
    check_inputs(op, ("proj", proj_SF2))
    check_shape(op, "proj", proj_SF2, (-1, -1))
    if proj_SF2.shape[1] % 2:
        raise KernelInputError(f"{op}: `proj` last dim {proj_SF2.shape[1]} is odd; expected [S, 2F]")
    return SwiGLU.apply(proj_SF2)


__all__ = ["swiglu"]
