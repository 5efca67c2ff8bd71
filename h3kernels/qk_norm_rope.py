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
# per program; backward programs loop over row tiles and keep their d_weight partial in registers; 1024 programs
# (about 8 per SM) and a 512 KB partials buffer. Fixed, so the reduction order does not depend on the machine.
# bench/knob_sweep.py on the H200 (session 15, bench/results/h200-session15d-sweep.log, S=16384 x 56 heads): the
# forward is fastest at 32 rows x 8 warps (0.169 ms, 138 registers); the backward at 8 rows x 2 warps runs 0.348 ms
# (147 registers, no spills) against 0.526 ms at the forward's tile (1 program per SM at 162 registers x 256 threads,
# so its serial tile loop hid no latency); 32 rows x 2 warps, 0.339 ms, spills ~900 bytes. At 8 x 2, 1024 programs
# beat 528 / 792 / 1584 (0.344 vs 0.456 / 0.364 / 0.481 ms, bench/results/h200-session15f-qk_programs.log).
# The interpreter takes 64-row tiles to run fewer Python-level programs.
QK_FWD_ROWS = 64 if is_interpreting() else 32
QK_FWD_WARPS = 8
QK_BWD_ROWS = 64 if is_interpreting() else 8
QK_BWD_WARPS = 2
QK_BWD_PROGRAMS = 4 if is_interpreting() else 1024
# 1: the backward reads cos/sin once per row tile when QK_BWD_ROWS divides NH (every tile is then heads of one s, as
# the real 56 heads in 8-row tiles); 0: per row, as measured in session 15. Written in session 16 to cut the loads
# that were half the loop's bytes. Timed in session 17 on an H100 (`bench/knob_sweep.py --ops qk_norm_rope`, S=16384):
# 0.391 ms against 0.380 ms per row, so it loses and stays 0 (bench/RESULTS.md).
QK_BWD_ROPE_PER_TILE = 0


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_piece(ptr, rows, rmask, cols, cmask, D):
    """The [rows, cols] piece of a [ROWS, D] tensor in fp32 (zeros where masked)."""
    return tl.load(ptr + rows[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _store_piece(ptr, rows, rmask, cols, cmask, D, value):
    """value, rounded once to ptr's dtype, into the [rows, cols] piece of a [ROWS, D] tensor."""
    tl.store(ptr + rows[:, None] * D + cols[None, :], cast_rne(value, ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _rope_table(ptr, rows, rmask, lo, lo_mask, half, NH, RD, row0, ROWS, PER_TILE: tl.constexpr):
    """cos or sin of the rows' positions at the two rotary halves: ([rows | 1, lo], [rows | 1, lo + half]), fp32.

    PER_TILE: every row of the tile has the position of its first row, row0 (one [1, lo] read per half; none for a
    tile past ROWS, the end of a program's last chunk); else one read per row.
    """
    if PER_TILE:
        base = (row0 // NH).to(tl.int64) * RD
        vm = lo_mask & (row0 + 0 * lo < ROWS)
        t1 = tl.load(ptr + base + lo, mask=vm, other=0.0).to(tl.float32)[None, :]
        t2 = tl.load(ptr + base + half + lo, mask=vm, other=0.0).to(tl.float32)[None, :]
    else:
        base = (rows // NH).to(tl.int64) * RD
        m2 = rmask[:, None] & lo_mask[None, :]
        t1 = tl.load(ptr + base[:, None] + lo[None, :], mask=m2, other=0.0).to(tl.float32)
        t2 = tl.load(ptr + base[:, None] + half + lo[None, :], mask=m2, other=0.0).to(tl.float32)
    return t1, t2


@triton.jit
def _qk_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr, ROWS, NH, D, RD, eps,
                   HAS_ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    """A row's D channels in three pieces: the rotary halves [0, RD/2) and [RD/2, RD) (HAS_ROPE), lane-aligned so
    that the rotation pairs lane j of one with lane j of the other, and the pass-through channels [RD, D)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < ROWS
    rest = RD + tl.arange(0, BLOCK_REST)
    rest_mask = rest < D
    # Upcast at load: fp32 statistics and no bf16 arithmetic in the interpreter.
    x3 = _load_piece(x_ptr, rows, rmask, rest, rest_mask, D)
    sumsq = tl.sum(x3 * x3, axis=1)
    if HAS_ROPE:
        half = RD // 2
        lo = tl.arange(0, BLOCK_HALF)
        lo_mask = lo < half
        x1 = _load_piece(x_ptr, rows, rmask, lo, lo_mask, D)
        x2 = _load_piece(x_ptr, rows, rmask, half + lo, lo_mask, D)
        sumsq += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.math.rsqrt(sumsq / D + eps)
    w3 = tl.load(w_ptr + rest, mask=rest_mask, other=0.0).to(tl.float32)
    _store_piece(y_ptr, rows, rmask, rest, rest_mask, D, x3 * rstd[:, None] * w3[None, :])
    if HAS_ROPE:
        n1 = x1 * rstd[:, None] * tl.load(w_ptr + lo, mask=lo_mask, other=0.0).to(tl.float32)[None, :]
        n2 = x2 * rstd[:, None] * tl.load(w_ptr + half + lo, mask=lo_mask, other=0.0).to(tl.float32)[None, :]
        # cos/sin stay fp32 (diffusers rounds them to the activation dtype before use).
        c1, c2 = _rope_table(cos_ptr, rows, rmask, lo, lo_mask, half, NH, RD, 0, ROWS, False)
        s1, s2 = _rope_table(sin_ptr, rows, rmask, lo, lo_mask, half, NH, RD, 0, ROWS, False)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): the normalized lanes are never rounded.
        _store_piece(y_ptr, rows, rmask, lo, lo_mask, D, n1 * c1 - n2 * s1)
        _store_piece(y_ptr, rows, rmask, half + lo, lo_mask, D, n2 * c2 + n1 * s2)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _qk_bwd_kernel(dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, pw_ptr, ROWS, NH, D, RD, ROWS_PER_PROG,
                   HAS_ROPE: tl.constexpr, ROPE_PER_TILE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """The forward's three pieces. ROPE_PER_TILE: BLOCK_ROWS divides NH, so every tile's rows are heads of one s and
    cos/sin are read once per tile (per row otherwise)."""
    pid = tl.program_id(0)
    rest = RD + tl.arange(0, BLOCK_REST)
    rest_mask = rest < D
    w3 = tl.load(w_ptr + rest, mask=rest_mask, other=0.0).to(tl.float32)
    dw3 = tl.zeros([BLOCK_REST], dtype=tl.float32)
    if HAS_ROPE:
        half = RD // 2
        lo = tl.arange(0, BLOCK_HALF)
        lo_mask = lo < half
        w1 = tl.load(w_ptr + lo, mask=lo_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + lo, mask=lo_mask, other=0.0).to(tl.float32)
        dw1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_ROWS):
        row0 = pid * ROWS_PER_PROG + r0
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        rmask = rows < ROWS
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        dn3 = _load_piece(dy_ptr, rows, rmask, rest, rest_mask, D)
        xh3 = _load_piece(x_ptr, rows, rmask, rest, rest_mask, D) * rstd[:, None]
        g3 = dn3 * w3[None, :]  # the gradient w.r.t. xhat
        dot = tl.sum(g3 * xh3, axis=1)
        dw3 += tl.sum(dn3 * xh3, axis=0)
        if HAS_ROPE:
            # The transposed rotation (by -angle) of dy gives the gradient w.r.t. the normalized lanes.
            dy1 = _load_piece(dy_ptr, rows, rmask, lo, lo_mask, D)
            dy2 = _load_piece(dy_ptr, rows, rmask, half + lo, lo_mask, D)
            c1, c2 = _rope_table(cos_ptr, rows, rmask, lo, lo_mask, half, NH, RD, row0, ROWS, ROPE_PER_TILE)
            s1, s2 = _rope_table(sin_ptr, rows, rmask, lo, lo_mask, half, NH, RD, row0, ROWS, ROPE_PER_TILE)
            dn1 = dy1 * c1 + dy2 * s2
            dn2 = dy2 * c2 - dy1 * s1
            xh1 = _load_piece(x_ptr, rows, rmask, lo, lo_mask, D) * rstd[:, None]
            xh2 = _load_piece(x_ptr, rows, rmask, half + lo, lo_mask, D) * rstd[:, None]
            g1 = dn1 * w1[None, :]
            g2 = dn2 * w2[None, :]
            dot += tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)
            dw1 += tl.sum(dn1 * xh1, axis=0)
            dw2 += tl.sum(dn2 * xh2, axis=0)
        dot = dot / D
        _store_piece(dx_ptr, rows, rmask, rest, rest_mask, D, rstd[:, None] * (g3 - xh3 * dot[:, None]))
        if HAS_ROPE:
            _store_piece(dx_ptr, rows, rmask, lo, lo_mask, D, rstd[:, None] * (g1 - xh1 * dot[:, None]))
            _store_piece(dx_ptr, rows, rmask, half + lo, lo_mask, D, rstd[:, None] * (g2 - xh2 * dot[:, None]))
    tl.store(pw_ptr + pid * D + rest, dw3, mask=rest_mask)
    if HAS_ROPE:
        tl.store(pw_ptr + pid * D + lo, dw1, mask=lo_mask)
        tl.store(pw_ptr + pid * D + half + lo, dw2, mask=lo_mask)


# ----------------------------------------------------------------------------------------------- launchers


def pieces(D: int, RD: int) -> dict[str, int]:
    """BLOCK_HALF (the rotary halves' lanes, RD/2 of them) and BLOCK_REST (the pass-through lanes, D - RD; one
    masked lane when there are none) of a head of D channels with rotary dim RD."""
    return dict(BLOCK_HALF=triton.next_power_of_2(max(1, RD // 2)),
                BLOCK_REST=triton.next_power_of_2(D - RD) if D > RD else 1)


def _qk_fwd(x, weight, cos, sin, eps):
    S, NH, D = x.shape
    rows = S * NH
    has_rope = cos is not None
    RD = cos.shape[1] if has_rope else 0
    y = new_empty(x.shape, x.dtype, x.device)
    rstd = new_empty((rows,), torch.float32, x.device)
    grid = (triton.cdiv(rows, QK_FWD_ROWS),)
    _qk_fwd_kernel[grid](x, weight, cos if has_rope else x, sin if has_rope else x, y, rstd, rows, NH, D, RD, eps,
                         HAS_ROPE=has_rope, BLOCK_ROWS=QK_FWD_ROWS, **pieces(D, RD), num_warps=QK_FWD_WARPS)
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
    per_tile = bool(QK_BWD_ROPE_PER_TILE) and NH % QK_BWD_ROWS == 0
    _qk_bwd_kernel[(n_prog,)](dy, x, weight, cos if has_rope else x, sin if has_rope else x, rstd, dx, pw, rows, NH,
                              D, RD, rows_per_prog, HAS_ROPE=has_rope, ROPE_PER_TILE=per_tile,
                              BLOCK_ROWS=QK_BWD_ROWS, **pieces(D, RD), num_warps=QK_BWD_WARPS)
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
