"""Per-head QK RMSNorm fused with the rotary embedding (attn.norm_q / norm_k + diffusers `_apply_rotary_emb`).

Legend: S packed-sequence rows, NH heads, D head dim, RD rotary dim (even, <= D), P backward programs.

qk_norm_rope(x_SND, weight_D, cos_SRD | None, sin_SRD | None, eps) -> y_SND
    per-head RMSNorm over D with weight (x * rsqrt(mean(x^2) + eps) * weight), then diffusers'
    `_apply_rotary_emb` on the leading RD channels (x1, x2 = the first RD channels halved; out = x*cos +
    cat(-x2, x1)*sin; the other D-RD channels pass through); no rotary when cos is None (refiner blocks).
    x float32 or bfloat16 [S, NH, D] (batch 1, contiguous), weight float32 or bfloat16 [D], cos/sin [S, RD]
    float32 (bf16 accepted, upcast). fp32 math with one rounding to x's dtype; cos/sin stay fp32 (diffusers
    rounds them to the activation dtype first, and rounds after the norm, the weight and the rotation).
    Backward (fused): the transposed rotation (rotation by -angle) applied to dy, then the RMSNorm backward;
    dx in x's dtype; d_weight from fp32 per-program partials [P, D] summed in a fixed order
    (modulation.finish_segments), rounded once to weight's dtype. No gradient for cos/sin (position buffers).

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16, shapes
that disagree, an odd or too large rotary dim, cos without sin, a negative eps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels._common import (
    KernelInputError,
    cast_rne,
    check_eps,
    check_inputs,
    check_shape,
    is_interpreting,
    new_empty,
)
from h3kernels.modulation import finish_segments

# Rows are (s, head) pairs of D channels, in tiles of QK_*_ROWS rows at QK_*_WARPS warps. The forward runs one tile
# per program; backward programs loop over row tiles and keep their d_weight partial in registers; 792 programs
# (six per SM on 132 SMs, with the prefetch below) and a 396 KB partials buffer. Fixed, so the reduction order does
# not depend on the machine.
# bench/knob_sweep.py on the H200 (session 15, bench/results/h200-session15d-sweep.log, S=16384 x 56 heads): the
# forward is fastest at 32 rows x 8 warps (0.169 ms); the backward at 8 rows x 2 warps runs 0.348 ms against
# 0.526 ms at the forward's tile, and 0.339 ms at 32 rows x 2 warps. Registers (ptxas sm_90, triton 3.9, with the JIT's
# alignment attributes): forward 64 at 32 x 8; backward 94 at 8 x 2, 93 at 32 x 8, 252 at 32 x 2, no spills. (The
# counts quoted here before session 20, 138 / 147 / 162 and ~900 bytes of spills at 32 x 2, came from a compile
# without those attributes, so the one-program-per-SM reason given for the forward tile's slow backward was wrong.)
# Without the prefetch, at 8 x 2, 1024 programs beat 528 / 792 / 1584 (0.344 vs 0.456 / 0.364 / 0.481 ms,
# bench/results/h200-session15f-qk_programs.log); with it 792 won (below).
# The interpreter takes 64-row tiles to run fewer Python-level programs.
QK_FWD_ROWS = 64 if is_interpreting() else 32
QK_FWD_WARPS = 8
# 1: with rotary, the forward runs one program per position s over its NH heads (a tile of next_pow2(NH) rows, 64
# for 56 heads, an eighth of them masked) and loads that position's cos/sin row once, broadcast over the heads;
# 0: tiles of QK_FWD_ROWS consecutive (s, head) rows, each row loading its own cos/sin (fp32, 768 bytes a row
# against x's 256: L1/L2 hits, but three times x's load traffic). Without rotary the forward always runs row tiles.
QK_FWD_PER_POSITION = 0
# 1: the forward's rotary takes each lane's partner (the other half of the rotary dims) from its own normalized tile
# with tl.gather along the head dim (warp shuffles where a row lies within a warp); 0: loads x and the weight
# again at the partner lanes (L1 hits: 192 + 192 bytes a row). The same product either way: byte-identical.
QK_FWD_GATHER = 0
QK_BWD_ROWS = 64 if is_interpreting() else 8
QK_BWD_WARPS = 2
QK_BWD_PROGRAMS = 4 if is_interpreting() else 792
# The backward reads cos/sin per row (L2 hits: one s's rows are 56 heads). A once-per-tile read (every 8-row tile is
# heads of one s) was written in session 16 and dropped in 22: on an H100 it lost without the prefetch below (0.391
# against 0.380 ms, session 17) and with it (0.385 against 0.313 ms at 792 programs; 136 registers, seven programs
# per SM, lost at every count timed; bench/results/h100-session22c-sweeps.log).
# 1: the backward issues the next tile's loads (dy, its partner lanes, cos/sin, x, rstd) before the current tile's
# math, two tiles' loads in flight per program, as norm.py's backwards do; 0: each tile's at its own step. Same bytes
# either way. It takes registers (ptxas sm_90, triton 3.9, 8 x 2: 161 against 96), so six programs fit an SM, not
# eight: QK_BWD_PROGRAMS goes with it. On an H100 at S=16384 (session 22, bench/results/h100-session22b-sweeps.log;
# prefetch x tiles 8 x 2 / 16 x 4 / 32 x 8 x 528 / 792 / 1024 programs): 0.311 ms with the prefetch at 8 x 2 and 792
# programs (six per SM, one wave; 76% of copy), against 0.380 ms (62%) for the old default (no prefetch, 1024);
# with the prefetch, 528 programs 0.330 and 1024 (a second wave) 0.415; the larger tiles 0.435 ms or slower.
QK_BWD_PREFETCH = 1
# 1: the backward takes dy[p(k)] sin[p(k)] as lane p(k) of its own dy * sin tile (tl.gather), so it loads dy and sin
# once each at the lanes themselves; 0: loads dy and sin again at the partner lanes. Byte-identical either way.
QK_BWD_GATHER = 0
# Above 1 (with QK_BWD_PREFETCH 0): the tile loop is a tl.range of that many stages, whose loads Triton pipelines
# through shared memory instead of the register prefetch (the loop has no barrier). ptxas sm_90 on the CPU (8 x 2,
# triton 3.9 / the PyPI 3.6.0 wheel): 3 stages 111 / 113 registers and 29 KB of shared memory, against 161 / 162
# with the prefetch and 96 with neither. 1: a plain loop. Not yet timed on a GPU.
QK_BWD_STAGES = 1


# ----------------------------------------------------------------------------------------------- kernels


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
                   HAS_ROPE: tl.constexpr, PER_POSITION: tl.constexpr, GATHER: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One tile of rows: BLOCK_ROWS consecutive (s, head) rows, or (PER_POSITION) the NH heads of position s =
    program id, whose one cos/sin row is loaded once and broadcast over the heads."""
    if PER_POSITION:
        pos = tl.program_id(0)
        heads = tl.arange(0, BLOCK_ROWS)
        rows = pos * NH + heads
        rmask = heads < NH
    else:
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
        # The normalized partner lane, never rounded: y's own lane `partner` (GATHER, in registers), or the same
        # product of x and w loaded again at the partner lanes.
        if GATHER:
            yp = tl.gather(y, tl.broadcast_to(partner[None, :], y.shape), axis=1)
        else:
            xp = tl.load(x_ptr + rows[:, None] * D + partner[None, :], mask=rm, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
            yp = xp * rstd[:, None] * wp[None, :]
        if PER_POSITION:  # [1, BLOCK_D]: one row of cos/sin for the whole tile
            cs_off = pos.to(tl.int64) * RD + cols[None, :]
            cs_mask = is_rot[None, :]
        else:
            cs_off = (rows // NH).to(tl.int64)[:, None] * RD + cols[None, :]
            cs_mask = rm
        # cos/sin stay fp32 (diffusers rounds them to the activation dtype before use).
        c = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
        y = tl.where(is_rot[None, :], y * c + sign[None, :] * yp * s, y)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty), mask=m2)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _qk_bwd_loads(dy_ptr, x_ptr, cos_ptr, sin_ptr, rstd_ptr, row0, ROWS, NH, D, RD, cols, cmask,
                  HAS_ROPE: tl.constexpr, GATHER: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Every load of the tile of rows [row0, row0 + BLOCK_ROWS), as stored (dy, x in their dtype): dy, dy at the
    partner lanes, cos, sin at the partner lanes, x, rstd. The prefetching loop issues them a tile ahead.

    Without rotary, dyp, c and sp are scalar placeholders. GATHER: dyp is one too, and sp is sin at the lanes
    themselves (the loop takes the partner lanes of dy * sin from the tile).
    """
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    rmask = rows < ROWS
    m2 = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=m2, other=0.0)
    dyp = 0.0
    c = 1.0
    sp = 0.0
    if HAS_ROPE:
        is_rot, partner, sign = _rope_lanes(cols, RD)
        rm = rmask[:, None] & is_rot[None, :]
        srow = (rows // NH).to(tl.int64) * RD
        c = tl.load(cos_ptr + srow[:, None] + cols[None, :], mask=rm, other=1.0)
        if GATHER:
            sp = tl.load(sin_ptr + srow[:, None] + cols[None, :], mask=rm, other=0.0)
        else:
            dyp = tl.load(dy_ptr + rows[:, None] * D + partner[None, :], mask=rm, other=0.0)
            sp = tl.load(sin_ptr + srow[:, None] + partner[None, :], mask=rm, other=0.0)
    x = tl.load(x_ptr + offs, mask=m2, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    return dy, dyp, c, sp, x, rstd


@triton.jit
def _qk_bwd_kernel(dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, pw_ptr, ROWS, NH, D, RD, ROWS_PER_PROG,
                   HAS_ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                   PREFETCH: tl.constexpr, GATHER: tl.constexpr, STAGES: tl.constexpr):
    """dx of the program's rows and its d_weight partial; PREFETCH issues the next tile's loads before this one's
    math, STAGES > 1 (without PREFETCH) lets Triton pipeline them through shared memory, GATHER takes dy's partner
    lanes from its tile (the same values every way)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid * ROWS_PER_PROG
    if PREFETCH:
        nxt = _qk_bwd_loads(dy_ptr, x_ptr, cos_ptr, sin_ptr, rstd_ptr, first, ROWS, NH, D, RD, cols, cmask,
                            HAS_ROPE, GATHER, BLOCK_ROWS)
    for r0 in tl.range(0, ROWS_PER_PROG, BLOCK_ROWS, num_stages=STAGES):
        row0 = first + r0
        if PREFETCH:
            dy_raw, dyp, c, sp, x_raw, rstd = nxt
            nxt = _qk_bwd_loads(dy_ptr, x_ptr, cos_ptr, sin_ptr, rstd_ptr, row0 + BLOCK_ROWS, ROWS, NH, D, RD, cols,
                                cmask, HAS_ROPE, GATHER, BLOCK_ROWS)
        else:
            dy_raw, dyp, c, sp, x_raw, rstd = _qk_bwd_loads(dy_ptr, x_ptr, cos_ptr, sin_ptr, rstd_ptr, row0, ROWS,
                                                            NH, D, RD, cols, cmask, HAS_ROPE, GATHER,
                                                            BLOCK_ROWS)
        dy = dy_raw.to(tl.float32)
        if HAS_ROPE:
            # Transposed rotation: d yn[k] = dy[k] cos[k] - sign[k] dy[p(k)] sin[p(k)] (sign[p(k)] = -sign[k]).
            is_rot, partner, sign = _rope_lanes(cols, RD)
            # GATHER: dy[p(k)] sin[p(k)] is lane p(k) of dy * sin (the same product; sign is exact).
            if GATHER:
                partner_dy_sin = tl.gather(dy * sp.to(tl.float32), tl.broadcast_to(partner[None, :], dy.shape), axis=1)
            else:
                partner_dy_sin = dyp.to(tl.float32) * sp.to(tl.float32)
            dy = tl.where(is_rot[None, :], dy * c.to(tl.float32) - sign[None, :] * partner_dy_sin, dy)
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        m2 = (rows < ROWS)[:, None] & cmask[None, :]
        xhat = x_raw.to(tl.float32) * rstd[:, None]
        dw += tl.sum(dy * xhat, axis=0)
        g = dy * w[None, :]
        cdot = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * cdot[:, None])
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], cast_rne(dx, dx_ptr.dtype.element_ty), mask=m2)
    tl.store(pw_ptr + pid * D + cols, dw, mask=cmask)


# ----------------------------------------------------------------------------------------------- launchers


def _qk_fwd(x, weight, cos, sin, eps):
    S, NH, D = x.shape
    rows = S * NH
    has_rope = cos is not None
    RD = cos.shape[1] if has_rope else 0
    y = new_empty(x.shape, x.dtype, x.device)
    rstd = new_empty((rows,), torch.float32, x.device)
    per_position = bool(QK_FWD_PER_POSITION) and has_rope
    block_rows = triton.next_power_of_2(NH) if per_position else QK_FWD_ROWS
    grid = (S if per_position else triton.cdiv(rows, block_rows),)
    _qk_fwd_kernel[grid](x, weight, cos if has_rope else x, sin if has_rope else x, y, rstd, rows, NH, D, RD, eps,
                         HAS_ROPE=has_rope, PER_POSITION=per_position, GATHER=QK_FWD_GATHER, BLOCK_ROWS=block_rows,
                         BLOCK_D=triton.next_power_of_2(D), num_warps=QK_FWD_WARPS)
    return y, rstd


def _qk_bwd(dy, x, weight, cos, sin, rstd):
    S, NH, D = x.shape
    rows = S * NH
    has_rope = cos is not None
    RD = cos.shape[1] if has_rope else 0
    blocks = triton.cdiv(rows, QK_BWD_ROWS)
    rows_per_prog = QK_BWD_ROWS * triton.cdiv(blocks, min(blocks, QK_BWD_PROGRAMS))
    n_prog = triton.cdiv(rows, rows_per_prog)
    dx = new_empty(x.shape, x.dtype, x.device)
    pw = new_empty((n_prog, 1, D), torch.float32, x.device)
    block_d = triton.next_power_of_2(D)
    _qk_bwd_kernel[(n_prog,)](dy, x, weight, cos if has_rope else x, sin if has_rope else x, rstd, dx, pw, rows, NH,
                              D, RD, rows_per_prog, HAS_ROPE=has_rope, BLOCK_ROWS=QK_BWD_ROWS, BLOCK_D=block_d,
                              PREFETCH=QK_BWD_PREFETCH, GATHER=QK_BWD_GATHER, STAGES=QK_BWD_STAGES,
                              num_warps=QK_BWD_WARPS)
    d_weight = new_empty((1, D), weight.dtype, x.device)
    finish_segments(pw, d_weight)
    return dx, d_weight.view(D)


# ----------------------------------------------------------------------------------------------- autograd


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
    return QKNormRope.apply(x_SND, weight_D, cos_SRD, sin_SRD, check_eps(op, eps))


__all__ = ["qk_norm_rope"]
