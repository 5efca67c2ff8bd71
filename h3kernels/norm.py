"""RMSNorm, RMSNorm fused with the AdaLN modulate, and per-head QK RMSNorm fused with the rotary embedding.

Legend: S packed-sequence rows, H hidden, R table rows (3*T for a block, T for norm_out), K column chunks of a
table row (6 for a block's table, 2 for norm_out's), NH heads, D head dim, RD rotary dim (even, <= D),
NC row chunks of the parameter-gradient reductions.

rms_norm(x_SH, weight_H, eps) -> y_SH
    y = x * rsqrt(mean(x^2) + eps) * weight (torch.nn.RMSNorm), fp32 math, one rounding to x's dtype.
rms_norm_modulate(x_SH, weight_H, table_RKH, idx_S, shift_chunk, scale_chunk, eps) -> y_SH
    y = rmsnorm(x) * weight * (1 + table[idx, scale]) + table[idx, shift], where table[r, c] is the H columns
    [c*H, (c+1)*H) of row r. The kernel reads the table rows by index (no gathered [S, H] tensors). The table is
    fp32 (from `modulation.adaln_table`) or bf16 (the diffusers path); it is upcast at load.
qk_norm_rope(x_SND, weight_D, cos_SRD | None, sin_SRD | None, eps) -> y_SND
    per-head RMSNorm over D with weight, then diffusers' `_apply_rotary_emb` on the leading RD channels
    (x1, x2 = first RD channels halved; out = x*cos + cat(-x2, x1)*sin; the other D-RD channels pass through),
    no rotary when cos is None. cos/sin stay fp32 (diffusers rounds them to the activation dtype first).
All: x float32 or bfloat16, weight float32 or bfloat16 (any mix), output in x's dtype; statistics, products and
sums in fp32 with one rounding per output element. The per-row rstd (fp32) is saved for backward.

Backward (fused, fp32 math): dx in x's dtype (row-wise kernel); d_weight in weight's dtype and d_table in the
table's dtype (only the shift and scale chunks non-zero) from fp32 per-chunk partials of dy*xhat and dy per
table row, summed in a fixed chunk order: no atomics, byte-identical reruns. d_weight of the modulated norm is
sum_r (1 + scale[r]) * P[r] with P[r] = sum over rows of table row r of dy * xhat (the same sum, grouped).
qk_norm_rope's backward applies the transposed rotation (rotation by -angle) to dy, then the RMSNorm backward;
d_weight partials are per program and summed in order. No gradient for cos/sin (position buffers).

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16, shapes
that disagree, a table width that is not a multiple of H, chunk numbers out of range or equal, out-of-range
indices, an odd or too large rotary dim, cos without sin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels._common import (
    KernelInputError,
    cast_rne,
    check_chunk,
    check_index,
    check_inputs,
    check_shape,
    is_interpreting,
    new_empty,
    num_warps_for,
    row_tile,
)
from h3kernels.modulation import FINISH_BLOCK_P, SEG_BLOCK_H, finish_segments, plan_segments

# Row-wise kernels hold a whole row (BLOCK_H = next_pow2(H); 8192 for H=5376) and `row_tile` rows per program.
# Parameter-gradient partial kernels use the segmented-sum plan of modulation.py (SEG_BLOCK_H columns, chunks
# of rows); their finish kernel sums FINISH_BLOCK_P chunks per step.
FINISH_BLOCK_H = 256
# qk_norm_rope: rows are (s, head) pairs of D channels. 32 rows x 128 channels = 4096 fp32 per tile (4 warps);
# the interpreter takes 64-row tiles to run fewer Python-level programs.
QK_BLOCK_ROWS = 64 if is_interpreting() else 32
# Backward programs loop over row tiles and keep their d_weight partial in registers; 1024 programs (about 8
# per SM) keep 28 tiles each at S=16384 x 56 heads and a 512 KB partials buffer. Fixed, so the reduction
# order does not depend on the machine.
QK_BWD_PROGRAMS = 4 if is_interpreting() else 1024


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
    for t0 in range(0, CHUNK_S, TILE_S):
        rows = pid_c * CHUNK_S + t0 + tl.arange(0, TILE_S)
        rmask = rows < S
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        dyx = dy * x * rstd[:, None]
        if HAS_MOD:
            ix = tl.load(idx_ptr + rows, mask=rmask, other=-1).to(tl.int32)
            for r in range(R):
                sel = ix[:, None] == r
                acc_p += tl.where(rids[:, None] == r, tl.sum(tl.where(sel, dyx, 0.0), axis=0)[None, :], 0.0)
                acc_q += tl.where(rids[:, None] == r, tl.sum(tl.where(sel, dy, 0.0), axis=0)[None, :], 0.0)
        else:
            acc_p += tl.where(rids[:, None] == 0, tl.sum(dyx, axis=0)[None, :], 0.0)
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


@triton.jit
def _rope_lanes(cols, RD):
    # rotate_half over the first RD channels: lane j < RD/2 pairs with j + RD/2 (sign -1), the second half with
    # j - RD/2 (sign +1); lanes >= RD are pass-through.
    half = RD // 2
    is_rot = cols < RD
    partner = tl.where(cols < half, cols + half, cols - half)
    partner = tl.where(is_rot, partner, cols)
    sign = tl.where(cols < half, -1.0, 1.0)
    return is_rot, partner, sign


@triton.jit
def _qk_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, ROWS, NH, D, RD, eps,
                   HAS_ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < ROWS
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_ROPE:
        is_rot, partner, sign = _rope_lanes(cols, RD)
        rm = rmask[:, None] & is_rot[None, :]
        xp = tl.load(x_ptr + rows[:, None] * D + partner[None, :], mask=rm, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
        yp = xp * rstd[:, None] * wp[None, :]  # the normalized partner lane, never rounded
        srow = (rows // NH).to(tl.int64) * RD
        # cos/sin stay fp32 (diffusers rounds them to the activation dtype before use).
        c = tl.load(cos_ptr + srow[:, None] + cols[None, :], mask=rm, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + srow[:, None] + cols[None, :], mask=rm, other=0.0).to(tl.float32)
        y = tl.where(is_rot[None, :], y * c + sign[None, :] * yp * s, y)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty), mask=m2)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _qk_bwd_kernel(dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, pw_ptr, ROWS, NH, D, RD, ROWS_PER_PROG,
                   HAS_ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_ROWS):
        rows = pid * ROWS_PER_PROG + r0 + tl.arange(0, BLOCK_ROWS)
        rmask = rows < ROWS
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        if HAS_ROPE:
            # Transposed rotation: d yn[k] = dy[k] cos[k] - sign[k] dy[p(k)] sin[p(k)] (sign[p(k)] = -sign[k]).
            is_rot, partner, sign = _rope_lanes(cols, RD)
            rm = rmask[:, None] & is_rot[None, :]
            dyp = tl.load(dy_ptr + rows[:, None] * D + partner[None, :], mask=rm, other=0.0).to(tl.float32)
            srow = (rows // NH).to(tl.int64) * RD
            c = tl.load(cos_ptr + srow[:, None] + cols[None, :], mask=rm, other=1.0).to(tl.float32)
            sp = tl.load(sin_ptr + srow[:, None] + partner[None, :], mask=rm, other=0.0).to(tl.float32)
            dy = tl.where(is_rot[None, :], dy * c - sign[None, :] * dyp * sp, dy)
        x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        dw += tl.sum(dy * xhat, axis=0)
        g = dy * w[None, :]
        cdot = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * cdot[:, None])
        tl.store(dx_ptr + offs, cast_rne(dx, dx_ptr.dtype.element_ty), mask=m2)
    tl.store(pw_ptr + pid * D + cols, dw, mask=cmask)


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
                                       TILE_S=tile, BLOCK_H=SEG_BLOCK_H, BLOCK_R=block_r, num_warps=4)
        d_weight = new_empty((H,), weight.dtype, x.device)
        # Chunks other than shift/scale get exact zeros (this op does not read them).
        d_table = torch.zeros_like(table) if has_mod else None
        _rms_bwd_finish_kernel[(triton.cdiv(H, FINISH_BLOCK_H),)](
            pp, pq, weight, tab, d_weight, d_table if has_mod else d_weight, nc, R, H, stride, shift_off,
            scale_off, HAS_MOD=has_mod, BLOCK_P=FINISH_BLOCK_P, BLOCK_H=FINISH_BLOCK_H, num_warps=4)
    return dx, d_weight, d_table


def _qk_fwd(x, weight, cos, sin, eps):
    S, NH, D = x.shape
    rows = S * NH
    has_rope = cos is not None
    RD = cos.shape[1] if has_rope else 0
    y = new_empty(x.shape, x.dtype, x.device)
    rstd = new_empty((rows,), torch.float32, x.device)
    block_d = triton.next_power_of_2(D)
    grid = (triton.cdiv(rows, QK_BLOCK_ROWS),)
    _qk_fwd_kernel[grid](x, weight, cos if has_rope else x, sin if has_rope else x, y, rstd, rows, NH, D, RD, eps,
                         HAS_ROPE=has_rope, BLOCK_ROWS=QK_BLOCK_ROWS, BLOCK_D=block_d,
                         num_warps=num_warps_for(QK_BLOCK_ROWS * block_d))
    return y, rstd


def _qk_bwd(dy, x, weight, cos, sin, rstd):
    S, NH, D = x.shape
    rows = S * NH
    has_rope = cos is not None
    RD = cos.shape[1] if has_rope else 0
    blocks = triton.cdiv(rows, QK_BLOCK_ROWS)
    rows_per_prog = QK_BLOCK_ROWS * triton.cdiv(blocks, min(blocks, QK_BWD_PROGRAMS))
    n_prog = triton.cdiv(rows, rows_per_prog)
    dx = new_empty(x.shape, x.dtype, x.device)
    pw = new_empty((n_prog, 1, D), torch.float32, x.device)
    block_d = triton.next_power_of_2(D)
    _qk_bwd_kernel[(n_prog,)](dy, x, weight, cos if has_rope else x, sin if has_rope else x, rstd, dx, pw, rows, NH,
                              D, RD, rows_per_prog, HAS_ROPE=has_rope, BLOCK_ROWS=QK_BLOCK_ROWS, BLOCK_D=block_d,
                              num_warps=num_warps_for(QK_BLOCK_ROWS * block_d))
    d_weight = new_empty((1, D), weight.dtype, x.device)
    finish_segments(pw, d_weight)
    return dx, d_weight.view(D)


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


class QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        y, rstd = _qk_fwd(x, weight, cos, sin, eps)
        ctx.save_for_backward(x, weight, cos, sin, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        dx, dw = _qk_bwd(dy.contiguous(), x, weight, cos, sin, rstd)
        return dx, dw if ctx.needs_input_grad[1] else None, None, None, None


# ----------------------------------------------------------------------------------------------- functional


def _check_eps(op: str, eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise KernelInputError(f"{op}: eps must be a non-negative float, got {eps!r}")
    return float(eps)


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, *extra) -> torch.device:
    dev = check_inputs(op, ("x", x), ("weight", weight), *extra)
    check_shape(op, "x", x, (-1, -1))
    check_shape(op, "weight", weight, (x.shape[1],))
    return dev


def rms_norm(x_SH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.RMSNorm over the last dim of a [S, H] tensor, fp32 math, one rounding."""
    _check_norm("rms_norm", x_SH, weight_H)
    return RMSNorm.apply(x_SH, weight_H, _check_eps("rms_norm", eps))


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
                                 _check_eps(op, eps))


def qk_norm_rope(x_SND: torch.Tensor, weight_D: torch.Tensor, cos_SRD: torch.Tensor | None,
                 sin_SRD: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over D, then rotary on the leading RD channels (none when cos is None)."""
    op = "qk_norm_rope"
    if (cos_SRD is None) != (sin_SRD is None):
        raise KernelInputError(f"{op}: cos and sin must both be given or both be None")
    rope = () if cos_SRD is None else (("cos", cos_SRD), ("sin", sin_SRD))
    check_inputs(op, ("x", x_SND), ("weight", weight_D), *rope)
    check_shape(op, "x", x_SND, (-1, -1, -1))
    S, _, D = x_SND.shape
    check_shape(op, "weight", weight_D, (D,))
    if cos_SRD is not None:
        check_shape(op, "cos", cos_SRD, (S, -1))
        check_shape(op, "sin", sin_SRD, tuple(cos_SRD.shape))
        rd = cos_SRD.shape[1]
        if rd % 2 or rd > D:
            raise KernelInputError(f"{op}: rotary dim {rd} must be even and <= head dim {D}")
    return QKNormRope.apply(x_SND, weight_D, cos_SRD, sin_SRD, _check_eps(op, eps))


__all__ = ["qk_norm_rope", "rms_norm", "rms_norm_modulate"]
