"""AdaLN modulation table (projection of the timestep embedding) and the deterministic segmented row sum.

Legend: T distinct timesteps, E time_embed_dim, C projection width (18*H for a block's `adaln_proj`, 2*H for
`norm_out.linear`), W table row width (6*H, or 2*H), R = T*C/W table rows, S packed-sequence rows, H hidden,
NC row chunks of a segmented sum.

adaln_table(temb_TE, weight_CE, bias_C, row_width=None) -> table_RW float32
    table = (silu(temb) @ weight^T + bias).view(-1, W), W = row_width or C // 3.
    silu runs on fp32 (temb is fp32 in the checkpoint; a bf16 temb is upcast at load), the GEMV accumulates in
    fp32 and the table stays fp32: diffusers rounds silu(temb) and the table to the bf16 weight dtype. Row
    t*(C/W) + m holds timestep t, modality m; for a block the six W/6 column chunks are shift_msa, scale_msa,
    gate_msa, shift_mlp, scale_mlp, gate_mlp (diffusers' `.view(-1, 6*H).chunk(6, -1)`).
    Backward (d_table float32 [R, W]): d_weight = d_table^T @ silu(temb) in fp32, rounded once to the weight
    dtype; d_bias = column sums in fp32, rounded once to the bias dtype; d_temb = (d_table @ weight) * silu'(temb)
    in fp32 (split-K partials summed in a fixed order), rounded to temb's dtype.
    Why: diffusers' index_select backward on its bf16 table is a bf16 atomic scatter-add, which puts the
    adaln_proj weight gradient ~0.16 rel-L2 from FP32 at S=16384; here the table and its gradient stay fp32.

segment_sum(values_SH, idx_S, num_rows) -> out_RH float32
    out[r] = sum of values[s] over rows s with idx[s] == r (rows with no entry are 0), fp32 accumulation in a
    fixed order (pass 1: per-chunk partials [NC, R, H] over fixed row chunks; pass 2: partials summed chunk by
    chunk), so two runs are byte-identical. values float32 or bfloat16 (upcast at load); idx int64/int32 in
    [0, num_rows). Backward: d_values = d_out[idx] (a gather, exact), in values' dtype.
    Pass 1 order within a chunk (the same helpers serve residual.py's table-gradient sums):
    - a chunk whose rows all have one table row r (`chunk_row`; a chunk running past S never counts) adds its
      TILE_S-row tiles elementwise into one fp32 running tile, in tile order, then sums that tile's rows once
      into row r;
    - any other chunk goes tile by tile (`add_tile`): a tile of one table row is summed once into that row,
      a mixed tile (or one running past S) takes R masked sums, one per table row.
    Why: packed sequences come in long runs of one table row (thousands of rows), so nearly every chunk is
    uniform. The R masked sums per tile cost about 4*R selects and adds per loaded value (a select and an add
    over the tile, then over the [BLOCK_R, BLOCK_H] accumulator, per table row; each thread sums its own column,
    so no barriers, per the sm_90 PTX), and the backward kernels built on them ran at 2-5% of copy bandwidth on
    the H200 (rms_norm_modulate bwd 5.15 ms vs torch's 2.17 ms at S=16384, H=5376); a uniform chunk costs one
    add per loaded value. Which path a chunk takes depends on the inputs only, so the order is still fixed for
    given inputs; the uniform-tile path gives the bits of the R-sum path (its other R-1 sums add +0.0).

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16
(indices int64/int32), shape disagreements, out-of-range indices, a row width that does not divide C.
No atomics anywhere; every reduction has a fixed order for given inputs (the segment chunks follow the index values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels._common import (
    INDEX_DTYPES,
    KernelInputError,
    cast_rne,
    check_index,
    check_inputs,
    check_shape,
    is_interpreting,
    new_empty,
    sigmoid_f32,
)

MODALITY_NUM = 3  # diffusers MINIMAX_H3_MODALITY_NUM: table rows per timestep (video, text, audio)

# GEMV tiles (forward and d_temb): BLOCK_C weight rows x BLOCK_E columns per step, products kept elementwise in a
# [BLOCK_T, BLOCK_C, BLOCK_E] fp32 accumulator and reduced once at the end. 16 x 256 at 4 warps: 123 / 147 registers
# (forward / d_temb) at BLOCK_T 2, 202 / 254 at BLOCK_T 4, no spills, for sm_90 (ptxas via triton's cuobjdump, on
# the CPU). 512-byte row segments per load; at the real width (C=96768, E=2688) the forward grid is 6048 programs.
# bench/adaln_tiles.py on the H200 (session 13, bench/RESULTS.md): 16x256 at 4 warps ran the forward at 69% of copy
# and forward + backward (d_temb, plus the untuned d_weight kernel) in 0.356 ms, the best pair of the 8 tiles timed;
# the same tile at 8 warps: 54% / 0.413 ms. The first version reduced across threads on every 64 x 64 step (41% of
# copy, 0.855 ms backward). On the interpreter the tile is larger so that fewer (slow, Python-level) programs run.
GEMV_BLOCK_C = 128 if is_interpreting() else 16
GEMV_BLOCK_E = 128 if is_interpreting() else 256
GEMV_WARPS = 4
# Software-pipeline stages of the GEMV loops (tl.range num_stages): above 1, triton streams the weight tiles through
# shared memory with cp.async, that many steps ahead, so a program keeps several tiles' loads in flight (96 / 120
# registers forward / d_temb at 3 stages against 123 / 154 at 1: ptxas sm_90, triton 3.9, BLOCK_T 2). On an H100
# (session 21, bench/results/h100-session21-sweeps.log, S=16384, 4 warps) forward / backward: 1 stage 0.207 / 0.406
# ms (83 / 85% of copy), 3 stages 0.185 / 0.394 (93 / 87%), 4 stages 0.182 / 0.398; 8 warps slower at every depth.
GEMV_STAGES = 3
# d_temb reduces over C: split C into about this many fixed ranges (grid = E/BLOCK_E x split, 21 x 64 at the
# real width), then sum the split partials in order. 64 fills the GPU; the interpreter needs few splits.
DTEMB_TARGET_SPLIT = 4 if is_interpreting() else 64
# d_weight outer product tile: 64 x 128 fp32 accumulators, written once as bf16.
DW_BLOCK_C = 64
DW_BLOCK_E = 128

# Segmented sums: BLOCK_H columns x TILE_S rows per step; a program owns a CHUNK of rows. 256 columns keep the
# [BLOCK_R, BLOCK_H] accumulators (R <= 16) and the [TILE_S, BLOCK_H] running tile of a uniform chunk small:
# at 8 warps segment_sum's partial kernel compiles without spills (sm_90, BLOCK_R 16, checked on the CPU by
# tests/kernels/test_compile.py), so two programs fit an SM. residual.py's backward uses these helpers with its
# own tile and chunk constants (GATED_*).
# Each thread holds one column of a tile, so a tile's row sums are in-thread; only `chunk_row` reduces across
# threads, once per chunk.
SEG_BLOCK_H = 256
SEG_WARPS = 8
SEG_TILE_S = 32 if is_interpreting() else 16
# Chunks per sequence: ~64 chunks (S=16384 -> 256 rows each) gives 64 x 21 = 1344 programs at H=5376 and a
# 12 MB partials buffer for R=9; the interpreter takes whole-tile chunks.
SEG_TARGET_CHUNKS = 4 if is_interpreting() else 64
# Pass 2 sums BLOCK_P chunk partials per step (fixed order: step by step, tree within a step) over BLOCK_N columns.
# 256 x 16, the shape norm.py's finish won with (its FINISH_BLOCK_P): qk_norm_rope's d_weight finish (792 partials of
# 128 columns) ran as one program of 50 dependent steps at the first default, 16 x 256. On an H100 at S=16384
# (session 26, bench/results/h100-session26-finish.log, copy 3022 GB/s), backward at 16 x 256 / 64 x 64 / 256 x 16:
# qk_norm_rope 0.313 / 0.283 / 0.279 ms (76% / 84% / 85% of copy), gated_residual 0.211 / 0.205 / 0.205,
# adaln_table 0.395 / 0.389 / 0.389; the forwards, which call no finish, within 0.001 ms.
FINISH_BLOCK_P = 256
FINISH_BLOCK_N = 16


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _adaln_fwd_kernel(temb_ptr, w_ptr, b_ptr, out_ptr, T, C, E,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < T
    # Elementwise fp32 products per (timestep, output, e) lane, summed over e once at the end: no cross-thread
    # reduction inside the loop, which streams the weight (each tile read once, serving every timestep).
    acc = tl.zeros([BLOCK_T, BLOCK_C, BLOCK_E], dtype=tl.float32)
    for e0 in tl.range(0, E, BLOCK_E, num_stages=STAGES):
        es = e0 + tl.arange(0, BLOCK_E)
        emask = es < E
        # Upcast before any arithmetic (bf16 math is wrong in the interpreter and we want fp32 products anyway).
        w = tl.load(w_ptr + cols[:, None] * E + es[None, :], mask=cmask[:, None] & emask[None, :], other=0.0)
        x = tl.load(temb_ptr + ts[:, None] * E + es[None, :], mask=tmask[:, None] & emask[None, :], other=0.0)
        x = x.to(tl.float32)
        s = x * sigmoid_f32(x)  # silu in fp32, never rounded to the weight dtype
        acc += w.to(tl.float32)[None, :, :] * s[:, None, :]
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    table = tl.sum(acc, axis=2) + bias[None, :]
    # The table stays fp32: no rounding to the weight dtype (the point of this op).
    tl.store(out_ptr + ts[:, None] * C + cols[None, :], table, mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _adaln_bwd_weight_kernel(temb_ptr, dtab_ptr, dw_ptr, db_ptr, T, C, E,
                             BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_e = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    es = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = es < E
    acc = tl.zeros([BLOCK_C, BLOCK_E], dtype=tl.float32)
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t in range(T):  # K = T (1-3): an outer-product sum in fp32, timesteps in order
        g = tl.load(dtab_ptr + t * C + cols, mask=cmask, other=0.0).to(tl.float32)
        x = tl.load(temb_ptr + t * E + es, mask=emask, other=0.0).to(tl.float32)
        s = x * sigmoid_f32(x)
        acc += g[:, None] * s[None, :]
        db += g
    # One rounding to the weight dtype, after the fp32 sum over timesteps.
    tl.store(dw_ptr + cols[:, None] * E + es[None, :], cast_rne(acc, dw_ptr.dtype.element_ty),
             mask=cmask[:, None] & emask[None, :])
    first = (cols * 0 + pid_e) == 0  # only the first E block writes d_bias (a vector mask: the interpreter needs one)
    tl.store(db_ptr + cols, cast_rne(db, db_ptr.dtype.element_ty), mask=cmask & first)


@triton.jit
def _adaln_bwd_temb_partial_kernel(w_ptr, dtab_ptr, part_ptr, T, C, E, C_PER_SPLIT,
                                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
                                   STAGES: tl.constexpr):
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    es = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = es < E
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < T
    # As in the forward: elementwise fp32 products, summed over this split's C rows once at the end.
    acc = tl.zeros([BLOCK_T, BLOCK_C, BLOCK_E], dtype=tl.float32)
    for c0 in tl.range(0, C_PER_SPLIT, BLOCK_C, num_stages=STAGES):
        cs = pid_s * C_PER_SPLIT + c0 + tl.arange(0, BLOCK_C)
        cmask = cs < C
        w = tl.load(w_ptr + cs[:, None] * E + es[None, :], mask=cmask[:, None] & emask[None, :], other=0.0)
        g = tl.load(dtab_ptr + ts[:, None] * C + cs[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * g.to(tl.float32)[:, :, None]
    offs = pid_s * T * E + ts[:, None] * E + es[None, :]
    tl.store(part_ptr + offs, tl.sum(acc, axis=1), mask=tmask[:, None] & emask[None, :])


# Segmented-sum building blocks, shared by the partial kernels here, in norm.py and in residual.py.


@triton.jit
def load_ix(idx_ptr, rows, S):
    """Table rows of sequence rows `rows` as int32; rows outside [0, S) read -1 (no table row)."""
    return tl.load(idx_ptr + rows, mask=rows < S, other=-1).to(tl.int32)


@triton.jit
def uniform_row(ix):
    """The single table row of a 1-D block of indices, or -1 where they differ (or all are -1).

    Rows past S are loaded as -1 (`load_ix`), so a block that runs past the end is never uniform.
    """
    lo = tl.min(ix, axis=0)
    hi = tl.max(ix, axis=0)
    return tl.where(lo == hi, lo, -1)


@triton.jit
def chunk_row(idx_ptr, start, S, CHUNK_S: tl.constexpr):
    """uniform_row of the CHUNK_S indices from `start`: one load and two reductions per chunk.

    CHUNK_S need not be a power of two: the padding lanes re-read the chunk's last row, which cannot change the
    answer.
    """
    lanes = tl.minimum(tl.arange(0, triton.next_power_of_2(CHUNK_S)), CHUNK_S - 1)
    return uniform_row(load_ix(idx_ptr, start + lanes, S))


@triton.jit
def add_row(acc, part, row, rids):
    """acc[row] += part (acc [BLOCK_R, BLOCK_H], part [BLOCK_H]); a row outside [0, BLOCK_R) adds nothing."""
    return acc + tl.where(rids[:, None] == row, part[None, :], 0.0)


@triton.jit
def add_tile(acc, v, ix, row, rids, R):
    """acc[r] += sum of v's rows with ix == r, for every r < R (v [TILE_S, BLOCK_H] fp32, ix [TILE_S] int32).

    `row` is uniform_row(ix), computed once by the caller (norm.py adds two values per tile). A uniform tile takes
    one reduction instead of R, with the same bits: where(all true, v, 0) is v, and the slow path's other R-1
    additions add +0.0, which changes no accumulator (they start at +0.0, so none holds -0.0).
    """
    if row >= 0:
        acc = add_row(acc, tl.sum(v, axis=0), row, rids)
    else:
        for r in range(R):
            acc = add_row(acc, tl.sum(tl.where(ix[:, None] == r, v, 0.0), axis=0), r, rids)
    return acc


@triton.jit
def _segment_values(val_ptr, rows, cols, S, H):
    """values[rows, cols] in fp32 (0 outside [0, S) x [0, H))."""
    m2 = (rows < S)[:, None] & (cols < H)[None, :]
    return tl.load(val_ptr + rows[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _segment_partials_kernel(val_ptr, idx_ptr, part_ptr, S, H, R,
                             CHUNK_S: tl.constexpr, TILE_S: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    rids = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    start = pid_c * CHUNK_S
    crow = chunk_row(idx_ptr, start, S, CHUNK_S)
    if crow >= 0:  # the whole chunk is one table row: elementwise adds, one reduction at the end
        run = tl.zeros([TILE_S, BLOCK_H], dtype=tl.float32)
        for t0 in range(0, CHUNK_S, TILE_S):
            run += _segment_values(val_ptr, start + t0 + tl.arange(0, TILE_S), cols, S, H)
        acc = add_row(acc, tl.sum(run, axis=0), crow, rids)
    else:
        for t0 in range(0, CHUNK_S, TILE_S):
            rows = start + t0 + tl.arange(0, TILE_S)
            ix = load_ix(idx_ptr, rows, S)
            acc = add_tile(acc, _segment_values(val_ptr, rows, cols, S, H), ix, uniform_row(ix), rids, R)
    offs = pid_c * R * H + rids[:, None] * H + cols[None, :]
    tl.store(part_ptr + offs, acc, mask=(rids[:, None] < R) & cmask[None, :])


@triton.jit
def _finish_kernel(part_ptr, out_ptr, aux_ptr, NC, R, N, K, out_row_stride, out_col_offset,
                   SILU_GRAD: tl.constexpr, ZERO_REST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[r, off + n] = sum_c part[c, r, n] in chunk order (times silu'(aux[r, n]) when SILU_GRAD); ZERO_REST: the
    row's other K - 1 column chunks of width N get exact zeros."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, NC, BLOCK_P):
        cs = c0 + tl.arange(0, BLOCK_P)
        tile = tl.load(part_ptr + cs[:, None] * R * N + r * N + cols[None, :],
                       mask=(cs[:, None] < NC) & cmask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    if SILU_GRAD:
        x = tl.load(aux_ptr + r * N + cols, mask=cmask, other=0.0).to(tl.float32)
        sg = sigmoid_f32(x)
        acc = acc * (sg * (1.0 + x * (1.0 - sg)))  # d silu(x) / dx, fp32
    tl.store(out_ptr + r * out_row_stride + out_col_offset + cols, cast_rne(acc, out_ptr.dtype.element_ty),
             mask=cmask)
    if ZERO_REST:
        zero = tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty)
        for k in range(K):
            if k * N != out_col_offset:
                tl.store(out_ptr + r * out_row_stride + k * N + cols, zero, mask=cmask)


# ----------------------------------------------------------------------------------------------- launchers


def plan_segments(S: int, R: int, tile: int | None = None, target_chunks: int | None = None
                  ) -> tuple[int, int, int, int]:
    """(CHUNK_S, TILE_S, BLOCK_R, NC) of a segmented row sum over S rows into R table rows, in tiles of `tile`
    rows (default SEG_TILE_S) and about `target_chunks` chunks (default SEG_TARGET_CHUNKS).

    The plan depends on its arguments only, so a given shape always reduces in the same order.
    """
    tile = tile or SEG_TILE_S
    chunk = max(tile, triton.cdiv(triton.cdiv(S, target_chunks or SEG_TARGET_CHUNKS), tile) * tile)
    block_r = max(2, triton.next_power_of_2(R))
    return chunk, tile, block_r, triton.cdiv(S, chunk)


def finish_segments(partials: torch.Tensor, out: torch.Tensor, col_offset: int = 0,
                    silu_of: torch.Tensor | None = None, zero_rest: bool = False) -> None:
    """Pass 2: out[r, col_offset:col_offset+N] = partials[:, r, :].sum(0) in chunk order, rounded to out.dtype.

    zero_rest: out's rows are whole chunks of N columns (col_offset one of them; the callers' input checks make it
    so) and the other chunks get exact zeros, so `out` may come from torch.empty (no zero-filling launch).
    """
    nc, r, n = partials.shape
    grid = (triton.cdiv(n, FINISH_BLOCK_N), r)
    aux = silu_of if silu_of is not None else partials
    _finish_kernel[grid](partials, out, aux, nc, r, n, out.shape[1] // n, out.stride(0), col_offset,
                         SILU_GRAD=silu_of is not None, ZERO_REST=zero_rest, BLOCK_P=FINISH_BLOCK_P,
                         BLOCK_N=FINISH_BLOCK_N, num_warps=4)


def _segment_sum_launch(values: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    S, H = values.shape
    chunk, tile, block_r, nc = plan_segments(S, num_rows)
    partials = new_empty((nc, num_rows, H), torch.float32, values.device)
    grid = (nc, triton.cdiv(H, SEG_BLOCK_H))
    _segment_partials_kernel[grid](values, idx, partials, S, H, num_rows, CHUNK_S=chunk, TILE_S=tile,
                                   BLOCK_H=SEG_BLOCK_H, BLOCK_R=block_r, num_warps=SEG_WARPS)
    out = new_empty((num_rows, H), torch.float32, values.device)
    finish_segments(partials, out)
    return out


def _adaln_fwd_launch(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    T, E = temb.shape
    C = weight.shape[0]
    out = new_empty((T, C), torch.float32, temb.device)
    block_t = max(2, triton.next_power_of_2(T))
    grid = (triton.cdiv(C, GEMV_BLOCK_C),)
    _adaln_fwd_kernel[grid](temb, weight, bias, out, T, C, E,
                            BLOCK_T=block_t, BLOCK_C=GEMV_BLOCK_C, BLOCK_E=GEMV_BLOCK_E, STAGES=GEMV_STAGES,
                            num_warps=GEMV_WARPS)
    return out


def _adaln_bwd_launch(temb, weight, bias, d_tab, need_temb, need_weight, need_bias):
    T, E = temb.shape
    C = weight.shape[0]
    dev = temb.device
    d_temb = d_weight = d_bias = None
    if need_weight or need_bias:
        d_weight = new_empty((C, E), weight.dtype, dev)
        d_bias = new_empty((C,), bias.dtype, dev)
        grid = (triton.cdiv(C, DW_BLOCK_C), triton.cdiv(E, DW_BLOCK_E))
        _adaln_bwd_weight_kernel[grid](temb, d_tab, d_weight, d_bias, T, C, E,
                                       BLOCK_C=DW_BLOCK_C, BLOCK_E=DW_BLOCK_E, num_warps=4)
    if need_temb:
        c_blocks = triton.cdiv(C, GEMV_BLOCK_C)
        c_per_split = GEMV_BLOCK_C * triton.cdiv(c_blocks, DTEMB_TARGET_SPLIT)
        split = triton.cdiv(C, c_per_split)
        partials = new_empty((split, T, E), torch.float32, dev)
        block_t = max(2, triton.next_power_of_2(T))
        grid = (triton.cdiv(E, GEMV_BLOCK_E), split)
        _adaln_bwd_temb_partial_kernel[grid](weight, d_tab, partials, T, C, E, c_per_split,
                                             BLOCK_T=block_t, BLOCK_C=GEMV_BLOCK_C, BLOCK_E=GEMV_BLOCK_E,
                                             STAGES=GEMV_STAGES, num_warps=GEMV_WARPS)
        d_temb = new_empty((T, E), temb.dtype, dev)
        finish_segments(partials, d_temb, silu_of=temb)
    return d_temb, d_weight, d_bias


# ----------------------------------------------------------------------------------------------- autograd


class AdaLNTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, temb, weight, bias, row_width):
        table = _adaln_fwd_launch(temb, weight, bias)
        ctx.save_for_backward(temb, weight, bias)
        return table.view(-1, row_width)

    @staticmethod
    def backward(ctx, d_table):
        temb, weight, bias = ctx.saved_tensors
        # The table is fp32, so its gradient is fp32; a bf16 upstream gradient is upcast (exact).
        d_tab = d_table.to(torch.float32).contiguous().view(temb.shape[0], weight.shape[0])
        need = ctx.needs_input_grad
        d_temb, d_weight, d_bias = _adaln_bwd_launch(temb, weight, bias, d_tab, need[0], need[1], need[2])
        return (d_temb if need[0] else None, d_weight if need[1] else None, d_bias if need[2] else None, None)


class SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, idx, num_rows):
        ctx.save_for_backward(idx)
        ctx.values_dtype = values.dtype
        return _segment_sum_launch(values, idx, num_rows)

    @staticmethod
    def backward(ctx, d_out):
        (idx,) = ctx.saved_tensors
        # A gather: no arithmetic, deterministic; the cast to bf16 values (if any) is the only rounding.
        return d_out.index_select(0, idx).to(ctx.values_dtype), None, None


# ----------------------------------------------------------------------------------------------- functional


def adaln_table(temb_TE: torch.Tensor, weight_CE: torch.Tensor, bias_C: torch.Tensor,
                row_width: int | None = None) -> torch.Tensor:
    """silu(temb) @ weight^T + bias in fp32, as a float32 [T*C/W, W] table (W = row_width or C // 3)."""
    op = "adaln_table"
    dev = check_inputs(op, ("temb", temb_TE), ("weight", weight_CE), ("bias", bias_C))
    check_shape(op, "temb", temb_TE, (-1, -1))
    T, E = temb_TE.shape
    check_shape(op, "weight", weight_CE, (-1, E))
    C = weight_CE.shape[0]
    check_shape(op, "bias", bias_C, (C,))
    width = C // MODALITY_NUM if row_width is None else row_width
    if not isinstance(width, int) or width <= 0 or C % width:
        raise KernelInputError(f"{op}: row width {width!r} does not divide the projection width C={C}")
    del dev
    return AdaLNTable.apply(temb_TE, weight_CE, bias_C, width)


def segment_sum(values_SH: torch.Tensor, idx_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Deterministic out[r] = sum(values[idx == r]) in fp32, shape [num_rows, H]."""
    op = "segment_sum"
    dev = check_inputs(op, ("values", values_SH))
    check_shape(op, "values", values_SH, (-1, -1))
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows <= 0:
        raise KernelInputError(f"{op}: num_rows must be a positive int, got {num_rows!r}")
    check_index(op, "idx", idx_S, values_SH.shape[0], num_rows, dev)
    return SegmentSum.apply(values_SH, idx_S, num_rows)


__all__ = ["INDEX_DTYPES", "MODALITY_NUM", "adaln_table", "finish_segments", "plan_segments", "segment_sum"]
