"""RMSNorm and RMSNorm fused with the AdaLN modulate (the per-head QK norm + rope lives in qk_norm_rope.py and is
re-exported here as `norm.qk_norm_rope`).

Legend: S packed-sequence rows, H hidden, R table rows (3*T for a block, T for norm_out), K column chunks of a
table row (6 for a block's table, 2 for norm_out's), NC row chunks of the parameter-gradient reductions.

rms_norm(x_SH, weight_H, eps) -> y_SH
    y = x * rsqrt(mean(x^2) + eps) * weight (torch.nn.RMSNorm), fp32 math, one rounding to x's dtype.
rms_norm_modulate(x_SH, weight_H, table_RKH, idx_S, shift_chunk, scale_chunk, eps) -> y_SH
    y = rmsnorm(x) * weight * (1 + table[idx, scale]) + table[idx, shift], where table[r, c] is the H columns
    [c*H, (c+1)*H) of row r. The kernel reads the table rows by index (no gathered [S, H] tensors). The table is
    fp32 (from `modulation.adaln_table`) or bf16 (the diffusers path); it is upcast at load.
All: x float32 or bfloat16, weight float32 or bfloat16 (any mix), output in x's dtype; statistics, products and
sums in fp32 with one rounding per output element. The per-row rstd (fp32) is saved for backward.

Backward (fused, fp32 math): dx in x's dtype (row-wise kernel); d_weight in weight's dtype and d_table in the
table's dtype (only the shift and scale chunks non-zero) from fp32 per-chunk partials of dy*xhat and dy per
table row, summed in a fixed chunk order: no atomics, byte-identical reruns. d_weight of the modulated norm is
sum_r (1 + scale[r]) * P[r] with P[r] = sum over rows of table row r of dy * xhat (the same sum, grouped).
Within a chunk the partials follow modulation.py's segmented-sum order: a chunk of one table row (always, for
the plain rms_norm) accumulates its tiles elementwise into two running tiles (dy*xhat, dy) and reduces them
once; other chunks go tile by tile, one sum per uniform tile, R masked sums per mixed tile (see segment_sum
there for why: packed rows come in long runs of one table row).

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16, shapes
that disagree, a table width that is not a multiple of H, chunk numbers out of range or equal, out-of-range
indices, a negative eps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels._common import (
    KernelInputError,
    cast_rne,
    check_chunk,
    check_eps,
    check_index,
    check_inputs,
    check_shape,
    new_empty,
    num_warps_for,
    row_tile,
)
from h3kernels.modulation import (
    FINISH_BLOCK_P,
    SEG_BLOCK_H,
    SEG_WARPS,
    add_row,
    add_tile,
    chunk_row,
    load_ix,
    plan_segments,
    uniform_row,
)
from h3kernels.qk_norm_rope import qk_norm_rope

# Row-wise kernels hold a whole row (BLOCK_H = next_pow2(H); 8192 for H=5376) and `row_tile` rows per program.
# Parameter-gradient partial kernels use the segmented-sum plan of modulation.py (SEG_BLOCK_H columns, chunks
# of rows); their finish kernel sums FINISH_BLOCK_P chunks per step.
FINISH_BLOCK_H = 256


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, tab_ptr, idx_ptr, y_ptr, rstd_ptr, S, H, tab_stride, shift_off, scale_off, eps,
                    HAS_MOD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = rows < S
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    m2 = rmask[:, None] & cmask[None, :]
    # Upcast at load: fp32 statistics (as torch's rms_norm) and no bf16 arithmetic in the interpreter.
    x = tl.load(x_ptr + rows[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_MOD:
        ix = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        base = ix[:, None] * tab_stride + cols[None, :]
        scale = tl.load(tab_ptr + base + scale_off, mask=m2, other=0.0).to(tl.float32)
        shift = tl.load(tab_ptr + base + shift_off, mask=m2, other=0.0).to(tl.float32)
        y = y * (1.0 + scale) + shift
    # The one rounding of the op (diffusers rounds after the norm, the weight, 1+scale, the product and the sum).
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty), mask=m2)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _rms_bwd_dx_kernel(dy_ptr, x_ptr, w_ptr, tab_ptr, idx_ptr, rstd_ptr, dx_ptr, S, H, tab_stride, scale_off,
                       HAS_MOD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = rows < S
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    m2 = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * H + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    g = dy * w[None, :]  # gradient w.r.t. xhat = x * rstd
    if HAS_MOD:
        ix = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        scale = tl.load(tab_ptr + ix[:, None] * tab_stride + cols[None, :] + scale_off, mask=m2, other=0.0)
        g = g * (1.0 + scale.to(tl.float32))
    xhat = x * rstd[:, None]
    c = tl.sum(g * xhat, axis=1) / H
    dx = rstd[:, None] * (g - xhat * c[:, None])
    tl.store(dx_ptr + offs, cast_rne(dx, dx_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _rms_bwd_tile(dy_ptr, x_ptr, rstd_ptr, rows, cols, S, H):
    """(dy, dy * xhat) of rows `rows` in fp32, zeros outside [0, S) x [0, H)."""
    rmask = rows < S
    m2 = rmask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    return dy, dy * x * rstd[:, None]


@triton.jit
def _rms_bwd_partials_kernel(dy_ptr, x_ptr, rstd_ptr, idx_ptr, pp_ptr, pq_ptr, S, H, R,
                             HAS_MOD: tl.constexpr, CHUNK_S: tl.constexpr, TILE_S: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """pp[c, r] = sum over chunk c's rows of table row r of dy * xhat; pq[c, r] the same of dy (HAS_MOD)."""
    pid_c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    rids = tl.arange(0, BLOCK_R)
    acc_p = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    acc_q = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    start = pid_c * CHUNK_S
    if HAS_MOD:
        crow = chunk_row(idx_ptr, start, S, CHUNK_S)
    else:
        crow = 0  # one "table row" (R = 1): every chunk takes the uniform path
    if crow >= 0:  # the whole chunk is one table row: elementwise adds, one reduction per sum at the end
        run_p = tl.zeros([TILE_S, BLOCK_H], dtype=tl.float32)
        run_q = tl.zeros([TILE_S, BLOCK_H], dtype=tl.float32)
        for t0 in range(0, CHUNK_S, TILE_S):
            dy, dyx = _rms_bwd_tile(dy_ptr, x_ptr, rstd_ptr, start + t0 + tl.arange(0, TILE_S), cols, S, H)
            run_p += dyx
            if HAS_MOD:
                run_q += dy
        acc_p = add_row(acc_p, tl.sum(run_p, axis=0), crow, rids)
        if HAS_MOD:
            acc_q = add_row(acc_q, tl.sum(run_q, axis=0), crow, rids)
    else:
        for t0 in range(0, CHUNK_S, TILE_S):
            rows = start + t0 + tl.arange(0, TILE_S)
            dy, dyx = _rms_bwd_tile(dy_ptr, x_ptr, rstd_ptr, rows, cols, S, H)
            ix = load_ix(idx_ptr, rows, S)
            row = uniform_row(ix)
            acc_p = add_tile(acc_p, dyx, ix, row, rids, R)
            acc_q = add_tile(acc_q, dy, ix, row, rids, R)
    offs_p = pid_c * R * H + rids[:, None] * H + cols[None, :]
    pmask = (rids[:, None] < R) & cmask[None, :]
    tl.store(pp_ptr + offs_p, acc_p, mask=pmask)
    if HAS_MOD:
        tl.store(pq_ptr + offs_p, acc_q, mask=pmask)


@triton.jit
def _rms_bwd_finish_kernel(pp_ptr, pq_ptr, w_ptr, tab_ptr, dw_ptr, dtab_ptr, NC, R, H, tab_stride, shift_off,
                           scale_off, HAS_MOD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in range(R):  # table rows in order, chunks in order within a row: a fixed reduction order
        p = tl.zeros([BLOCK_H], dtype=tl.float32)
        q = tl.zeros([BLOCK_H], dtype=tl.float32)
        for c0 in range(0, NC, BLOCK_P):
            cs = c0 + tl.arange(0, BLOCK_P)
            offs = cs[:, None] * R * H + r * H + cols[None, :]
            m2 = (cs[:, None] < NC) & cmask[None, :]
            p += tl.sum(tl.load(pp_ptr + offs, mask=m2, other=0.0), axis=0)
            if HAS_MOD:
                q += tl.sum(tl.load(pq_ptr + offs, mask=m2, other=0.0), axis=0)
        if HAS_MOD:
            row = r * tab_stride + cols
            scale = tl.load(tab_ptr + row + scale_off, mask=cmask, other=0.0).to(tl.float32)
            dw += p * (1.0 + scale)
            # d_table rounds once to the table's dtype (fp32 for the candidate's table: no rounding).
            tl.store(dtab_ptr + row + scale_off, cast_rne(p * w, dtab_ptr.dtype.element_ty), mask=cmask)
            tl.store(dtab_ptr + row + shift_off, cast_rne(q, dtab_ptr.dtype.element_ty), mask=cmask)
        else:
            dw += p
    tl.store(dw_ptr + cols, cast_rne(dw, dw_ptr.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------- launchers


def _row_plan(S: int, H: int) -> tuple[int, int, int, int]:
    block_h = triton.next_power_of_2(H)
    block_s = row_tile(block_h)
    return block_h, block_s, triton.cdiv(S, block_s), num_warps_for(block_s * block_h)


def _rms_fwd(x, weight, table, idx, shift_off, scale_off, eps):
    S, H = x.shape
    has_mod = table is not None
    y = new_empty((S, H), x.dtype, x.device)
    rstd = new_empty((S,), torch.float32, x.device)
    block_h, block_s, n_prog, warps = _row_plan(S, H)
    _rms_fwd_kernel[(n_prog,)](x, weight, table if has_mod else x, idx if has_mod else rstd, y, rstd, S, H,
                               table.stride(0) if has_mod else 0, shift_off, scale_off, eps,
                               HAS_MOD=has_mod, BLOCK_S=block_s, BLOCK_H=block_h, num_warps=warps)
    return y, rstd


def _rms_bwd(dy, x, weight, table, idx, rstd, shift_off, scale_off, need_x, need_w, need_t):
    S, H = x.shape
    has_mod = table is not None
    tab = table if has_mod else x
    ix = idx if has_mod else rstd
    stride = table.stride(0) if has_mod else 0
    dx = d_weight = d_table = None
    if need_x:
        dx = new_empty((S, H), x.dtype, x.device)
        block_h, block_s, n_prog, warps = _row_plan(S, H)
        _rms_bwd_dx_kernel[(n_prog,)](dy, x, weight, tab, ix, rstd, dx, S, H, stride, scale_off,
                                      HAS_MOD=has_mod, BLOCK_S=block_s, BLOCK_H=block_h, num_warps=warps)
    if need_w or need_t:
        R = table.shape[0] if has_mod else 1
        chunk, tile, block_r, nc = plan_segments(S, R)
        pp = new_empty((nc, R, H), torch.float32, x.device)
        pq = new_empty((nc, R, H), torch.float32, x.device) if has_mod else pp
        grid = (nc, triton.cdiv(H, SEG_BLOCK_H))
        _rms_bwd_partials_kernel[grid](dy, x, rstd, ix, pp, pq, S, H, R, HAS_MOD=has_mod, CHUNK_S=chunk,
                                       TILE_S=tile, BLOCK_H=SEG_BLOCK_H, BLOCK_R=block_r, num_warps=SEG_WARPS)
        d_weight = new_empty((H,), weight.dtype, x.device)
        # Chunks other than shift/scale get exact zeros (this op does not read them).
        d_table = torch.zeros_like(table) if has_mod else None
        _rms_bwd_finish_kernel[(triton.cdiv(H, FINISH_BLOCK_H),)](
            pp, pq, weight, tab, d_weight, d_table if has_mod else d_weight, nc, R, H, stride, shift_off,
            scale_off, HAS_MOD=has_mod, BLOCK_P=FINISH_BLOCK_P, BLOCK_H=FINISH_BLOCK_H, num_warps=4)
    return dx, d_weight, d_table


# ----------------------------------------------------------------------------------------------- autograd


class RMSNormModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, table, idx, shift_off, scale_off, eps):
        y, rstd = _rms_fwd(x, weight, table, idx, shift_off, scale_off, eps)
        ctx.save_for_backward(x, weight, table, idx, rstd)
        ctx.offs = (shift_off, scale_off)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, table, idx, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, dt = _rms_bwd(dy.contiguous(), x, weight, table, idx, rstd, *ctx.offs, need[0], need[1], need[2])
        return dx, dw if need[1] else None, dt if need[2] else None, None, None, None, None


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_fwd(x, weight, None, None, 0, 0, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, _ = _rms_bwd(dy.contiguous(), x, weight, None, None, rstd, 0, 0, need[0], need[1], False)
        return dx, dw, None


# ----------------------------------------------------------------------------------------------- functional


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, *extra) -> torch.device:
    dev = check_inputs(op, ("x", x), ("weight", weight), *extra)
    check_shape(op, "x", x, (-1, -1))
    check_shape(op, "weight", weight, (x.shape[1],))
    return dev


def rms_norm(x_SH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.RMSNorm over the last dim of a [S, H] tensor, fp32 math, one rounding."""
    _check_norm("rms_norm", x_SH, weight_H)
    return RMSNorm.apply(x_SH, weight_H, check_eps("rms_norm", eps))


def rms_norm_modulate(x_SH: torch.Tensor, weight_H: torch.Tensor, table_RKH: torch.Tensor, idx_S: torch.Tensor,
                      shift_chunk: int, scale_chunk: int, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight * (1 + table[idx, scale_chunk]) + table[idx, shift_chunk], one rounding."""
    op = "rms_norm_modulate"
    dev = _check_norm(op, x_SH, weight_H, ("table", table_RKH))
    check_shape(op, "table", table_RKH, (-1, -1))
    S, H = x_SH.shape
    R, width = table_RKH.shape
    if width % H:
        raise KernelInputError(f"{op}: table width {width} is not a multiple of H={H}")
    check_chunk(op, "shift_chunk", shift_chunk, width // H)
    check_chunk(op, "scale_chunk", scale_chunk, width // H)
    if shift_chunk == scale_chunk:
        raise KernelInputError(f"{op}: shift_chunk and scale_chunk are both {shift_chunk}")
    check_index(op, "idx", idx_S, S, R, dev)
    return RMSNormModulate.apply(x_SH, weight_H, table_RKH, idx_S, shift_chunk * H, scale_chunk * H,
                                 check_eps(op, eps))


__all__ = ["qk_norm_rope", "rms_norm", "rms_norm_modulate"]
