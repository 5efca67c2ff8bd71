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

Backward (fp32 math), one kernel pass over dy and x plus a small finish kernel: dx in x's dtype; d_weight in
weight's dtype and d_table in the table's dtype (only the shift and scale chunks non-zero) from fp32 per-chunk
partials of dy*xhat and dy per table row, summed in a fixed chunk order: no atomics, byte-identical reruns.
d_weight of the modulated norm is sum_r (1 + scale[r]) * P[r] with P[r] = sum over rows of table row r of
dy * xhat (the same sum, grouped). Within a chunk (fixed rows, a function of S), a run of rows of one table row
adds its tile sums in row order into a register row, which is stored to (or, when the chunk met that table row
before, added to) the chunk's partial row when the run ends; a tile that mixes table rows (narrow widths only)
adds its masked sums, table row by table row. Partial rows a chunk never touched are neither written nor read
(a per-chunk flag says which), so no buffer is zero-filled.

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
    is_interpreting,
    load_row_pair,
    new_empty,
    num_warps_for,
    row_tile,
)
from h3kernels.qk_norm_rope import qk_norm_rope

# Every kernel holds whole rows in tiles of `row_tile` rows (1 at the real width, up to 16 at narrow widths), a row's
# columns in two power-of-two pieces (`_pieces`: one block of next_pow2(H) = 8192 for H=5376 plus one masked lane,
# or, split, 4096 + 2048). The forward runs one tile per program and reads its table rows per row.
# The backward runs one program per row chunk of about S / NORM_BWD_CHUNKS rows (a multiple of the tile; it depends
# on S and this constant only, which fixes the parameter-gradient reduction order for a shape), looping over its
# tiles at NORM_BWD_WARPS warps; it keeps the scale factor of the last table row it met in registers (packed rows
# come in runs of one table row thousands of rows long). On the H200 at S=16384 (session 15), bench/knob_sweep.py
# with bench/block.py's launch-hiding timer (bench/results/h200-session15d-sweep.log): 132 chunks (one per SM) ran
# rms_norm_modulate's backward in 0.279 ms at 16 warps (0.282 at 8, 0.278 at 32), against 0.313 at 100 chunks and
# 0.348 at 264. Its first version (bench/results/h200-session15-norm-sweep.log, whose timer could still include
# host launch time, which favours fewer launches) timed the alternatives norm.py dropped: reloading the factor per
# row 0.315 ms, dx and the partials in two launches 0.437 ms, and looped forwards no faster than this one-tile
# forward (0.143 vs 0.140 ms; plain norm 0.117 vs 0.094 ms). In two pieces (below) 8 warps won on an H100 (session
# 19) for both norms. Registers (ptxas sm_90, triton 3.9, with the JIT's alignment attributes as
# tests/kernels/test_compile.py compiles; counts quoted before session 20 came from a compile without them, 2-byte
# loads, and were too high): two pieces at 8 warps, 224 (modulated) / 152 (plain), no spills; one 8192-lane block,
# 251 / 230, and at 16 warps (128 at most) the modulated one spills 32 bytes.
NORM_BWD_WARPS = 8
NORM_BWD_CHUNKS = 4 if is_interpreting() else 132
# 1: the backward issues every load of the next tile (dy, x, rstd and the table rows) before the current tile's math
# (two tiles' loads in flight per program: the loop is latency-bound at one program per SM); 0: each tile's loads at
# its own step. Same bytes either way. Until session 22 the prefetch left rstd and the table rows in the tile's own
# step, and it won for the plain norm only (H100, session 18: 0.222 against 0.258 ms) and lost for the modulated one,
# whose table-row load then gated each step. With them prefetched too, on an H100 at S=16384 (session 22,
# bench/results/h100-session22b-sweeps.log, two pieces, 8 warps): rms_norm_modulate's backward 0.267 ms against
# 0.303 (66% against 58% of copy), rms_norm's 0.218 (80%). Registers (ptxas sm_90, triton 3.9): 244 / 204, no spills.
NORM_BWD_PREFETCH = 1
# 1: the backward runs _rms_bwd_runs_kernel, whose tile loop Triton pipelines NORM_BWD_STAGES deep through shared
# memory (the prefetch's registers freed, two tiles' loads in flight at 3 stages); 0: _rms_bwd_kernel with the
# register prefetch above. Not yet timed on a GPU: the one that loses goes. ptxas sm_90 on the CPU (H=5376, split,
# 8 warps, triton 3.9 / the PyPI 3.6.0 wheel): _rms_bwd_kernel's loop under tl.range num_stages was not pipelined
# (the flush's barrier is in it); the runs kernel at 3 stages takes 188 / 219 registers (modulated; 142 / 193
# plain) and 48 KB of shared memory, against 244 / 204 (3.9) for _rms_bwd_kernel with the prefetch.
NORM_BWD_RUNS = 0
NORM_BWD_STAGES = 3
# The columns (`_pieces`). 1: a row of a width H that is not a power of two in two power-of-two pieces (4096 + 2048
# lanes for H=5376, against one block of 8192: a quarter fewer registers); 0: one block. NORM_FWD_WARPS 0 picks
# num_warps_for(the tile's lanes): 8 at H=5376. On the H200 at S=16384 (session 19,
# bench/results/h200-session19-norm_fwd_sweep.log): the modulated forward ran in 0.122 ms split against 0.138 ms
# in one block (68% against 60% of copy), the plain one in 0.104 against 0.093 ms: split for the modulated norm
# only. Not a register limit: at 8 warps the modulated forward takes 55 registers split and 72 in one block (three
# programs per SM or more either way; the session-19 counts, 92 / 150, came from the compile without alignment).
# 4 warps tied 8 for both (0.122 / 0.093 ms); 16 lost (0.160 / 0.094).
MODULATE_FWD_SPLIT = 1
RMS_NORM_FWD_SPLIT = 0
NORM_FWD_WARPS = 0
# The backwards' columns, as the forwards'. On an H100 at S=16384 (session 19, bench/results/h100-session19b-
# norm_bwd_sweep.log; split x prefetch x 8 / 16 warps): rms_norm_modulate's backward ran fastest split, without the
# prefetch, at 8 warps (0.304 ms, 58% of copy; one block at 16 warps, the old default, 0.314), rms_norm's split,
# with the prefetch, at 8 warps (0.225 ms, 78%; one block with the prefetch at 16 warps 0.250). Split, neither
# spills at 16 warps (ptxas on the CPU: 0 and 40 bytes against 104 and 152 in one block). Session 22's sweep, with
# the whole-tile prefetch, again put both backwards fastest split at 8 warps.
MODULATE_BWD_SPLIT = 1
RMS_NORM_BWD_SPLIT = 1
# The finish kernel: one program per FINISH_BLOCK_H columns loops over the table rows (FINISH_BLOCK_R at a time) and,
# per row, over the chunk partials FINISH_BLOCK_P at a time (each step two dependent loads: the touched flags, then the
# partials they mask), so a program runs cdiv(R, FINISH_BLOCK_R) * cdiv(NC, FINISH_BLOCK_P) latency-bound steps. At 16 x
# 256 (the first default) that was 54 steps for a block's R=6 at 132 chunks: on an H100 at S=16384 (session 23,
# bench/results/h100-session23b-finish.log, copy 3022 GB/s) rms_norm_modulate's backward ran 0.268 ms (66% of copy),
# rms_norm's 0.218 (80%); one step per table row at 256 x 16 (336 programs) 0.222 (79%) and 0.208 (84%); 128 x 32 0.227
# / 0.208, 64 x 64 0.233 / 0.211. FINISH_BLOCK_R > 1 takes that many table rows (at most next_pow2(R)) per step as one
# 3D tile, their touched flags as one load first: a block's R=6 in one step of one dependent load pair instead of six
# (the tile's values, FINISH_BLOCK_P * FINISH_BLOCK_R * FINISH_BLOCK_H, fixed at 4096 above, are then shared with fewer
# columns; at 4 warps the finish held them in registers, FINISH_WARPS 8 halves that per thread).
FINISH_BLOCK_P = 256
FINISH_BLOCK_R = 1
FINISH_BLOCK_H = 16
FINISH_WARPS = 4


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile_row(ix, rmask):
    """The one table row of a tile's rows inside [0, S), or -1 where they differ.

    Rows past S are masked to zeros in every load, so they may count as any table row.
    """
    lo = tl.min(tl.where(rmask, ix, 2147483647), axis=0)
    hi = tl.max(tl.where(rmask, ix, -1), axis=0)
    return tl.where(lo == hi, lo, -1)


@triton.jit
def _load_ix(idx_ptr, rows, rmask, HAS_MOD: tl.constexpr):
    """Table rows of `rows` as int32 (all 0 without modulation: the plain norm sums into one row)."""
    if HAS_MOD:
        ix = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int32)
    else:
        ix = tl.zeros(rows.shape, dtype=tl.int32)
    return ix


@triton.jit
def _load_row_stats(rstd_ptr, idx_ptr, t0, end, TILE_S: tl.constexpr, HAS_MOD: tl.constexpr):
    """rstd and table rows (int32) of the tile of rows [t0, t0 + TILE_S) below `end`: the small per-row loads that
    the backward's prefetch issues a tile ahead with dy and x, so none of a step's loads waits in its own step."""
    rows = t0 + tl.arange(0, TILE_S)
    rmask = rows < end
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    return rstd, _load_ix(idx_ptr, rows, rmask, HAS_MOD)


@triton.jit
def _factor(w_ptr, tab_ptr, ix, tab_stride, scale_off, cols, cmask, HAS_MOD: tl.constexpr):
    """weight * (1 + table[ix, scale]) in fp32 (the weight alone without modulation), the per-column factor of
    xhat at columns `cols`. `ix` is one table row (a [piece] result) or a tile's rows (a [TILE_S, piece] result, the
    same bits)."""
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_MOD:
        if len(ix.shape) == 0:
            scale = tl.load(tab_ptr + ix * tab_stride + scale_off + cols, mask=cmask, other=0.0,
                            eviction_policy="evict_last")
        else:
            base = ix.to(tl.int64)[:, None] * tab_stride + scale_off + cols[None, :]
            scale = tl.load(tab_ptr + base, mask=cmask[None, :], other=0.0)
        w = w * (1.0 + scale.to(tl.float32))
    return w


@triton.jit
def _fwd_piece(x, rstd, w_ptr, tab_ptr, ix, y_ptr, rows, rmask, cols, H, shift_off, scale_off,
               HAS_MOD: tl.constexpr):
    """y of one column piece of a tile: x (fp32, [TILE_S, piece]) times rstd, the weight and the modulation."""
    cmask = cols < H
    m2 = rmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_MOD:
        base = ix[:, None] + cols[None, :]
        scale = tl.load(tab_ptr + base + scale_off, mask=m2, other=0.0).to(tl.float32)
        shift = tl.load(tab_ptr + base + shift_off, mask=m2, other=0.0).to(tl.float32)
        y = y * (1.0 + scale) + shift
    # The one rounding of the op (diffusers rounds after the norm, the weight, 1+scale, the product and the sum).
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, tab_ptr, idx_ptr, y_ptr, rstd_ptr, S, H, tab_stride, shift_off, scale_off, eps,
                    HAS_MOD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """One tile of BLOCK_S rows; a row's columns in two pieces, [0, BLOCK_A) and the BLOCK_B after it."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = rows < S
    cols_a = tl.arange(0, BLOCK_A)
    # Upcast at load: fp32 statistics (as torch's rms_norm) and no bf16 arithmetic in the interpreter.
    xa = tl.load(x_ptr + rows[:, None] * H + cols_a[None, :], mask=rmask[:, None] & (cols_a < H)[None, :],
                 other=0.0).to(tl.float32)
    cols_b = BLOCK_A + tl.arange(0, BLOCK_B)
    xb = tl.load(x_ptr + rows[:, None] * H + cols_b[None, :], mask=rmask[:, None] & (cols_b < H)[None, :],
                 other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) / H + eps)
    ix = tl.zeros([BLOCK_S], dtype=tl.int64)
    if HAS_MOD:
        ix = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64) * tab_stride
    _fwd_piece(xa, rstd, w_ptr, tab_ptr, ix, y_ptr, rows, rmask, cols_a, H, shift_off, scale_off, HAS_MOD)
    _fwd_piece(xb, rstd, w_ptr, tab_ptr, ix, y_ptr, rows, rmask, cols_b, H, shift_off, scale_off, HAS_MOD)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _seen_before(idx_ptr, start, pos, r, HAS_MOD: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """Whether table row r occurs in rows [start, pos) of the chunk, i.e. its partial row is already stored."""
    if HAS_MOD:
        lanes = start + tl.arange(0, BLOCK_CHUNK)
        ix = tl.load(idx_ptr + lanes, mask=lanes < pos, other=-1).to(tl.int32)
        seen = tl.max((ix == r).to(tl.int32), axis=0) > 0
    else:
        seen = pos > start
    return seen


@triton.jit
def _flush_piece(pp_ptr, pq_ptr, row_off, seen, part_p, part_q, cols, H, HAS_MOD: tl.constexpr):
    cmask = cols < H
    if seen:
        tl.debug_barrier()  # this program's earlier store of the row is visible to all its threads
        part_p += tl.load(pp_ptr + row_off + cols, mask=cmask, other=0.0)
        if HAS_MOD:
            part_q += tl.load(pq_ptr + row_off + cols, mask=cmask, other=0.0)
    tl.store(pp_ptr + row_off + cols, part_p, mask=cmask)
    if HAS_MOD:
        tl.store(pq_ptr + row_off + cols, part_q, mask=cmask)


@triton.jit
def _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, r, start, seg_start, pa, qa, cols_a, pb, qb, cols_b,
           HAS_MOD: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """pp[c, r] = (pa, pb) (pq[c, r] = (qa, qb)), a row's two column pieces, on the chunk's first rows of table row
    r; += on a later run of it."""
    row_off = (c * R + r).to(tl.int64) * H
    seen = _seen_before(idx_ptr, start, seg_start, r, HAS_MOD, BLOCK_CHUNK)
    _flush_piece(pp_ptr, pq_ptr, row_off, seen, pa, qa, cols_a, H, HAS_MOD)
    _flush_piece(pp_ptr, pq_ptr, row_off, seen, pb, qb, cols_b, H, HAS_MOD)


@triton.jit
def _store_dx(dx_ptr, rows, rmask, cols, H, rstd, g, xhat, dot):
    """dx = rstd * (g - xhat * dot) of one column piece of a tile, rounded once to dx's dtype."""
    dx = rstd[:, None] * (g - xhat * dot[:, None])
    tl.store(dx_ptr + rows[:, None] * H + cols[None, :], cast_rne(dx, dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < H)[None, :])


@triton.jit
def _chunk_frame(S, H, chunk_rows, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """A backward program's chunk c, the columns of a row's two pieces and their masks, and its rows [start, end)."""
    c = tl.program_id(0)
    cols_a = tl.arange(0, BLOCK_A)
    cols_b = BLOCK_A + tl.arange(0, BLOCK_B)
    start = c * chunk_rows
    return c, cols_a, cols_b, cols_a < H, cols_b < H, start, tl.minimum(start + chunk_rows, S)


@triton.jit
def _chunk_table_rows(idx_ptr, start, end, HAS_MOD: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """The chunk's rows as lanes and their table rows (-1 at lanes past `end`)."""
    lanes = start + tl.arange(0, BLOCK_CHUNK)
    return lanes, tl.where(lanes < end, _load_ix(idx_ptr, lanes, lanes < end, HAS_MOD), -1)


@triton.jit
def _store_touched(touched_ptr, c, R, cix):
    """touched[c, r] = whether the chunk has rows of table row r, for every r: no zero-filled buffer to launch."""
    for r in range(R):
        tl.store(touched_ptr + c * R + r, tl.max((cix == r).to(tl.int8), axis=0))


@triton.jit
def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, tab_ptr, idx_ptr, rstd_ptr, dx_ptr, pp_ptr, pq_ptr, touched_ptr,
                    S, H, R, tab_stride, scale_off, chunk_rows,
                    HAS_MOD: tl.constexpr, NEED_DX: tl.constexpr, NEED_PARAMS: tl.constexpr,
                    TILE_S: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """dx of chunk c's rows, and the chunk's partials pp[c, r] = sum of dy * xhat over its rows of table row r,
    pq[c, r] the same of dy (HAS_MOD), with touched[c, r] = 1 where the chunk has rows of table row r.

    A row's columns are two pieces (suffix _a: [0, BLOCK_A), _b: the BLOCK_B after it), each its own tensors. One
    pass over dy and x. The partials of the current run of one table row accumulate in registers (fp32, tile sums
    in row order) and are flushed when the run ends; a tile that mixes table rows (TILE_S > 1 only) adds its masked
    sums per table row, in table-row order. Untouched partials are never written or read.
    """
    c, cols_a, cols_b, cmask_a, cmask_b, start, end = _chunk_frame(S, H, chunk_rows, BLOCK_A, BLOCK_B)
    cached = tl.full([], -1, tl.int32)  # the table row whose factor is in registers
    fa = _factor(w_ptr, tab_ptr, cached, tab_stride, scale_off, cols_a, cmask_a, False)
    fb = _factor(w_ptr, tab_ptr, cached, tab_stride, scale_off, cols_b, cmask_b, False)
    seg = tl.full([], -1, tl.int32)  # the table row of the open run (-1: none)
    seg_start = start
    pa = tl.zeros([BLOCK_A], dtype=tl.float32)
    qa = tl.zeros([BLOCK_A], dtype=tl.float32)
    pb = tl.zeros([BLOCK_B], dtype=tl.float32)
    qb = tl.zeros([BLOCK_B], dtype=tl.float32)
    if PREFETCH:
        dya_next, xa_next = load_row_pair(dy_ptr, x_ptr, start, end, cols_a, cmask_a, H, TILE_S)
        dyb_next, xb_next = load_row_pair(dy_ptr, x_ptr, start, end, cols_b, cmask_b, H, TILE_S)
        rstd_next, ix_next = _load_row_stats(rstd_ptr, idx_ptr, start, end, TILE_S, HAS_MOD)
    for t0 in range(start, end, TILE_S):
        rows = t0 + tl.arange(0, TILE_S)
        rmask = rows < end
        if PREFETCH:  # this tile's loads were issued one step ago; the next tile's start before its math
            dya_raw, xa_raw, dyb_raw, xb_raw, rstd, ix = dya_next, xa_next, dyb_next, xb_next, rstd_next, ix_next
            dya_next, xa_next = load_row_pair(dy_ptr, x_ptr, t0 + TILE_S, end, cols_a, cmask_a, H, TILE_S)
            dyb_next, xb_next = load_row_pair(dy_ptr, x_ptr, t0 + TILE_S, end, cols_b, cmask_b, H, TILE_S)
            rstd_next, ix_next = _load_row_stats(rstd_ptr, idx_ptr, t0 + TILE_S, end, TILE_S, HAS_MOD)
        else:
            dya_raw, xa_raw = load_row_pair(dy_ptr, x_ptr, t0, end, cols_a, cmask_a, H, TILE_S)
            dyb_raw, xb_raw = load_row_pair(dy_ptr, x_ptr, t0, end, cols_b, cmask_b, H, TILE_S)
            rstd, ix = _load_row_stats(rstd_ptr, idx_ptr, t0, end, TILE_S, HAS_MOD)
        dya = dya_raw.to(tl.float32)
        dyb = dyb_raw.to(tl.float32)
        xha = xa_raw.to(tl.float32) * rstd[:, None]
        xhb = xb_raw.to(tl.float32) * rstd[:, None]
        row = _tile_row(ix, rmask)
        if TILE_S == 1:
            uniform = True  # static: the compiler drops the mixed-tile path, which a 1-row tile never takes
        else:
            uniform = row >= 0
        if NEED_DX:
            if uniform:
                if row != cached:
                    fa = _factor(w_ptr, tab_ptr, row, tab_stride, scale_off, cols_a, cmask_a, HAS_MOD)
                    fb = _factor(w_ptr, tab_ptr, row, tab_stride, scale_off, cols_b, cmask_b, HAS_MOD)
                    cached = row
                ga = dya * fa[None, :]  # the gradient w.r.t. xhat
                gb = dyb * fb[None, :]
            else:
                ga = dya * _factor(w_ptr, tab_ptr, ix, tab_stride, scale_off, cols_a, cmask_a, HAS_MOD)
                gb = dyb * _factor(w_ptr, tab_ptr, ix, tab_stride, scale_off, cols_b, cmask_b, HAS_MOD)
            dot = (tl.sum(ga * xha, axis=1) + tl.sum(gb * xhb, axis=1)) / H
            _store_dx(dx_ptr, rows, rmask, cols_a, H, rstd, ga, xha, dot)
            _store_dx(dx_ptr, rows, rmask, cols_b, H, rstd, gb, xhb, dot)
        if NEED_PARAMS:
            dyxa = dya * xha
            dyxb = dyb * xhb
            if uniform:
                if row != seg:
                    if seg >= 0:
                        _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, seg, start, seg_start, pa, qa, cols_a, pb, qb,
                               cols_b, HAS_MOD, BLOCK_CHUNK)
                    pa = tl.zeros([BLOCK_A], dtype=tl.float32)
                    qa = tl.zeros([BLOCK_A], dtype=tl.float32)
                    pb = tl.zeros([BLOCK_B], dtype=tl.float32)
                    qb = tl.zeros([BLOCK_B], dtype=tl.float32)
                    seg = row
                    seg_start = t0
                pa += tl.sum(dyxa, axis=0)
                pb += tl.sum(dyxb, axis=0)
                if HAS_MOD:
                    qa += tl.sum(dya, axis=0)
                    qb += tl.sum(dyb, axis=0)
            else:
                if seg >= 0:
                    _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, seg, start, seg_start, pa, qa, cols_a, pb, qb, cols_b,
                           HAS_MOD, BLOCK_CHUNK)
                seg = tl.full([], -1, tl.int32)
                for r in range(R):
                    sel = (ix == r) & rmask
                    if tl.max(sel.to(tl.int32), axis=0) > 0:
                        _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, r, start, t0,
                               tl.sum(tl.where(sel[:, None], dyxa, 0.0), axis=0),
                               tl.sum(tl.where(sel[:, None], dya, 0.0), axis=0), cols_a,
                               tl.sum(tl.where(sel[:, None], dyxb, 0.0), axis=0),
                               tl.sum(tl.where(sel[:, None], dyb, 0.0), axis=0), cols_b, HAS_MOD, BLOCK_CHUNK)
    if NEED_PARAMS:
        if seg >= 0:
            _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, seg, start, seg_start, pa, qa, cols_a, pb, qb, cols_b,
                   HAS_MOD, BLOCK_CHUNK)
        _store_touched(touched_ptr, c, R, _chunk_table_rows(idx_ptr, start, end, HAS_MOD, BLOCK_CHUNK)[1])


@triton.jit
def _rms_bwd_runs_kernel(dy_ptr, x_ptr, w_ptr, tab_ptr, idx_ptr, rstd_ptr, dx_ptr, pp_ptr, pq_ptr, touched_ptr,
                         S, H, R, tab_stride, scale_off, chunk_rows,
                         HAS_MOD: tl.constexpr, NEED_DX: tl.constexpr, NEED_PARAMS: tl.constexpr,
                         TILE_S: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_CHUNK: tl.constexpr, STAGES: tl.constexpr):
    """_rms_bwd_kernel's outputs, looping over the chunk's runs of one table row, and within a run over its tiles.

    The run loop (the factor loaded once per run, the partials flushed after it) holds the flush's barrier, so the
    tile loop has no branch and no barrier and Triton pipelines its loads STAGES deep through shared memory
    (tl.range num_stages), where _rms_bwd_kernel prefetches one tile ahead in registers. A tile that straddles a
    run's ends (TILE_S > 1 only) runs once per run with the other run's rows masked.
    """
    c, cols_a, cols_b, cmask_a, cmask_b, start, end = _chunk_frame(S, H, chunk_rows, BLOCK_A, BLOCK_B)
    lanes, cix = _chunk_table_rows(idx_ptr, start, end, HAS_MOD, BLOCK_CHUNK)
    run_start = start
    while run_start < end:
        r = tl.max(tl.where(lanes == run_start, cix, -1), axis=0)
        # Lanes at or past `end` hold -1, never r: the run ends at the first other table row or at `end`.
        run_end = tl.min(tl.where((lanes > run_start) & (cix != r), lanes, end), axis=0)
        fa = _factor(w_ptr, tab_ptr, r, tab_stride, scale_off, cols_a, cmask_a, HAS_MOD)
        fb = _factor(w_ptr, tab_ptr, r, tab_stride, scale_off, cols_b, cmask_b, HAS_MOD)
        pa = tl.zeros([BLOCK_A], dtype=tl.float32)
        qa = tl.zeros([BLOCK_A], dtype=tl.float32)
        pb = tl.zeros([BLOCK_B], dtype=tl.float32)
        qb = tl.zeros([BLOCK_B], dtype=tl.float32)
        first_tile = start + (run_start - start) // TILE_S * TILE_S  # tiles stay aligned to the chunk's start
        for t0 in tl.range(first_tile, run_end, TILE_S, num_stages=STAGES):
            rows = t0 + tl.arange(0, TILE_S)
            rmask = (rows >= run_start) & (rows < run_end)
            dya_raw, xa_raw = load_row_pair(dy_ptr, x_ptr, t0, run_end, cols_a, cmask_a, H, TILE_S)
            dyb_raw, xb_raw = load_row_pair(dy_ptr, x_ptr, t0, run_end, cols_b, cmask_b, H, TILE_S)
            rstd, _ = _load_row_stats(rstd_ptr, idx_ptr, t0, run_end, TILE_S, False)
            rstd = tl.where(rmask, rstd, 0.0)  # rows before the run: xhat and dy zero, nothing summed
            dya = tl.where(rmask[:, None], dya_raw.to(tl.float32), 0.0)
            dyb = tl.where(rmask[:, None], dyb_raw.to(tl.float32), 0.0)
            xha = xa_raw.to(tl.float32) * rstd[:, None]
            xhb = xb_raw.to(tl.float32) * rstd[:, None]
            if NEED_DX:
                ga = dya * fa[None, :]
                gb = dyb * fb[None, :]
                dot = (tl.sum(ga * xha, axis=1) + tl.sum(gb * xhb, axis=1)) / H
                _store_dx(dx_ptr, rows, rmask, cols_a, H, rstd, ga, xha, dot)
                _store_dx(dx_ptr, rows, rmask, cols_b, H, rstd, gb, xhb, dot)
            if NEED_PARAMS:
                pa += tl.sum(dya * xha, axis=0)
                pb += tl.sum(dyb * xhb, axis=0)
                if HAS_MOD:
                    qa += tl.sum(dya, axis=0)
                    qb += tl.sum(dyb, axis=0)
        if NEED_PARAMS:
            _flush(pp_ptr, pq_ptr, idx_ptr, c, R, H, r, start, run_start, pa, qa, cols_a, pb, qb, cols_b, HAS_MOD,
                   BLOCK_CHUNK)
        run_start = run_end
    if NEED_PARAMS:
        _store_touched(touched_ptr, c, R, cix)


@triton.jit
def _rms_bwd_finish_kernel(pp_ptr, pq_ptr, touched_ptr, w_ptr, tab_ptr, dw_ptr, dtab_ptr, NC, R, H, K, tab_stride,
                           shift_off, scale_off, HAS_MOD: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """d_weight (and d_table: all K chunks of its rows, the ones other than shift and scale zero) of BLOCK_H columns.

    Table rows BLOCK_R at a time, and per such block the chunk partials BLOCK_P at a time as one [BLOCK_P, BLOCK_R,
    BLOCK_H] tile, masked by the touched flags of those chunks and rows (one [BLOCK_P, BLOCK_R] load first). Chunks
    in order, then table rows in order: a fixed reduction order.
    """
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < R
        p = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        q = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for c0 in range(0, NC, BLOCK_P):
            cs = c0 + tl.arange(0, BLOCK_P)
            part = cs[:, None] * R + rr[None, :]  # [BLOCK_P, BLOCK_R] partial rows
            hit = tl.load(touched_ptr + part, mask=(cs < NC)[:, None] & rmask[None, :], other=0) != 0
            offs = part.to(tl.int64)[:, :, None] * H + cols[None, None, :]
            m3 = hit[:, :, None] & cmask[None, None, :]
            p += tl.sum(tl.load(pp_ptr + offs, mask=m3, other=0.0), axis=0)
            if HAS_MOD:
                q += tl.sum(tl.load(pq_ptr + offs, mask=m3, other=0.0), axis=0)
        if HAS_MOD:
            row = rr[:, None] * tab_stride + cols[None, :]
            m2 = rmask[:, None] & cmask[None, :]
            scale = tl.load(tab_ptr + row + scale_off, mask=m2, other=0.0).to(tl.float32)
            dw += tl.sum(p * (1.0 + scale), axis=0)
            # d_table rounds once to the table's dtype (fp32 for the candidate's table: no rounding).
            tl.store(dtab_ptr + row + scale_off, cast_rne(p * w[None, :], dtab_ptr.dtype.element_ty), mask=m2)
            tl.store(dtab_ptr + row + shift_off, cast_rne(q, dtab_ptr.dtype.element_ty), mask=m2)
            zero = tl.zeros([BLOCK_R, BLOCK_H], dtype=dtab_ptr.dtype.element_ty)
            for k in range(K):  # this op does not read the other chunks: exact zeros, no separate zero-filled buffer
                if (k * H != shift_off) and (k * H != scale_off):
                    tl.store(dtab_ptr + row + k * H, zero, mask=m2)
        else:
            dw += tl.sum(p, axis=0)
    tl.store(dw_ptr + cols, cast_rne(dw, dw_ptr.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------- launchers


def _pieces(H: int, split: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B), the two power-of-two column pieces of a row of width H.

    Split: half of next_pow2(H) and the power of two that covers the rest (4096 + 2048 for H=5376). Not split, or H
    a power of two: one block of next_pow2(H) and a second piece of one lane past H, which every access masks.
    """
    block = triton.next_power_of_2(H)
    if not split or block == H:
        return block, 1
    return block // 2, triton.next_power_of_2(H - block // 2)


def _tile(H: int) -> int:
    """Rows per tile (the same split or not: the pieces never cover more than next_pow2(H) columns)."""
    return row_tile(triton.next_power_of_2(H))


def fwd_launch(H: int, has_mod: bool) -> dict[str, int]:
    """The forward's launch constants for the modulated (has_mod) or the plain norm at width H."""
    block_a, block_b = _pieces(H, MODULATE_FWD_SPLIT if has_mod else RMS_NORM_FWD_SPLIT)
    tile = _tile(H)
    return dict(BLOCK_S=tile, BLOCK_A=block_a, BLOCK_B=block_b,
                num_warps=NORM_FWD_WARPS or num_warps_for(tile * (block_a + block_b)))


def bwd_launch(H: int, has_mod: bool) -> dict[str, int]:
    """The backward's launch constants but BLOCK_CHUNK: twice the forward's warps (it holds about twice the fp32
    values per row), at most NORM_BWD_WARPS."""
    block_a, block_b = _pieces(H, MODULATE_BWD_SPLIT if has_mod else RMS_NORM_BWD_SPLIT)
    tile = _tile(H)
    return dict(TILE_S=tile, BLOCK_A=block_a, BLOCK_B=block_b,
                PREFETCH=NORM_BWD_PREFETCH,
                num_warps=min(NORM_BWD_WARPS, 2 * num_warps_for(tile * (block_a + block_b))))


def bwd_plan(S: int, H: int) -> tuple[int, int]:
    """(chunk rows, chunks) of the backward: depends on (S, H) and NORM_BWD_CHUNKS only."""
    tile = _tile(H)
    rows = tile * triton.cdiv(triton.cdiv(S, tile), NORM_BWD_CHUNKS)
    return rows, triton.cdiv(S, rows)


def _rms_fwd(x, weight, table, idx, shift_off, scale_off, eps):
    S, H = x.shape
    has_mod = table is not None
    y = new_empty((S, H), x.dtype, x.device)
    rstd = new_empty((S,), torch.float32, x.device)
    launch = fwd_launch(H, has_mod)
    _rms_fwd_kernel[(triton.cdiv(S, launch["BLOCK_S"]),)](x, weight, table if has_mod else x,
                                                          idx if has_mod else rstd, y, rstd, S, H,
                                                          table.stride(0) if has_mod else 0, shift_off, scale_off,
                                                          eps, HAS_MOD=has_mod, **launch)
    return y, rstd


def _rms_bwd(dy, x, weight, table, idx, rstd, shift_off, scale_off, need_x, need_w, need_t):
    S, H = x.shape
    has_mod = table is not None
    need_params = need_w or need_t
    R = table.shape[0] if has_mod else 1
    chunk, nc = bwd_plan(S, H)
    dx = new_empty((S, H), x.dtype, x.device) if need_x else dy
    pp = pq = touched = rstd
    if need_params:
        pp = new_empty((nc, R, H), torch.float32, x.device)
        pq = new_empty((nc, R, H), torch.float32, x.device) if has_mod else pp
        touched = new_empty((nc, R), torch.int8, x.device)
    tab, ix, stride = (table, idx, table.stride(0)) if has_mod else (x, rstd, 0)
    launch = bwd_launch(H, has_mod)
    kernel = _rms_bwd_kernel
    if NORM_BWD_RUNS:  # its loads are pipelined, not prefetched
        kernel = _rms_bwd_runs_kernel
        del launch["PREFETCH"]
        launch["STAGES"] = NORM_BWD_STAGES
    kernel[(nc,)](dy, x, weight, tab, ix, rstd, dx, pp, pq, touched, S, H, R, stride, scale_off, chunk,
                  HAS_MOD=has_mod, NEED_DX=need_x, NEED_PARAMS=need_params, BLOCK_CHUNK=triton.next_power_of_2(chunk),
                  **launch)
    d_weight = d_table = None
    if need_params:
        d_weight = new_empty((H,), weight.dtype, x.device)
        d_table = new_empty(tuple(table.shape), table.dtype, x.device) if has_mod else None
        _rms_bwd_finish_kernel[(triton.cdiv(H, FINISH_BLOCK_H),)](
            pp, pq, touched, weight, tab, d_weight, d_table if has_mod else d_weight, nc, R, H, stride // H, stride,
            shift_off, scale_off, HAS_MOD=has_mod, BLOCK_P=FINISH_BLOCK_P,
            BLOCK_R=min(FINISH_BLOCK_R, triton.next_power_of_2(R)), BLOCK_H=FINISH_BLOCK_H, num_warps=FINISH_WARPS)
    return (dx if need_x else None), d_weight, d_table


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
