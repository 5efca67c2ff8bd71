"""Gated residual of the AdaLN blocks and the plain residual add of the refiner blocks.

Legend: S packed-sequence rows, H hidden, R table rows, K column chunks of a table row (6 for a block),
NC row chunks of the table-gradient reduction.

gated_residual(x_SH, branch_SH, table_RKH, idx_S, gate_chunk) -> y_SH
    y = x + table[idx, gate_chunk] * branch, where table[r, c] is the H columns [c*H, (c+1)*H) of row r; fp32
    math, one rounding to x's dtype. The kernel reads the gate rows by index (no gathered [S, H] gate).
    x and branch float32 or bfloat16 (the same dtype); table float32 (modulation.adaln_table) or bfloat16.
    Backward: dx = dy (the same tensor); d_branch = dy * gate[idx] in fp32, rounded to branch's dtype; d_table
    holds, in its gate chunk, sum over rows s with idx[s] == r of dy[s] * branch[s] (fp32 per-chunk partials
    fused into the d_branch kernel, summed in a fixed chunk order by modulation.finish_segments), zeros
    elsewhere, in the table's dtype. Within a chunk the partials follow modulation.py's segmented-sum order
    (a chunk of one table row: elementwise running tile, one reduction, and its gate row loaded once instead of
    gathered per row; other chunks tile by tile; see segment_sum there for why).
residual_add(x_SH, branch_SH) -> y_SH
    y = x + branch in fp32, one rounding (bit-identical to torch's add for float32 and bfloat16). Any shape.
    Backward: dx = d_branch = dy.

Rejected (KernelInputError): empty, non-contiguous, mixed devices, dtypes other than float32/bfloat16, x and
branch of different dtypes or shapes, a table width that is not a multiple of H, gate_chunk out of range,
out-of-range indices.
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
    load_row_pair,
    new_empty,
)
from h3kernels.modulation import (
    add_row,
    add_tile,
    chunk_row,
    finish_segments,
    load_ix,
    plan_segments,
    uniform_row,
)

# Elementwise tiles: 4096 values per program, 32 per thread at 4 warps (four 16 B bf16 vectors per operand);
# the interpreter takes 4x larger tiles so fewer Python-level programs run.
ELEM_TILE = 16384 if is_interpreting() else 4096
ELEM_MAX_BLOCK_H = 1024  # a [4, 1024] tile at H=5376: 6 column blocks per row, coalesced 2 KB row segments
ADD_BLOCK = 16384 if is_interpreting() else 4096
# The backward's segmented table-gradient sums (modulation.py's order): GATED_BLOCK_H columns x GATED_TILE_S rows
# per step at GATED_WARPS warps, about GATED_CHUNKS row chunks (S=16384: 64 chunks of 256 rows x 11 column blocks
# = 704 programs at H=5376). Fixed numbers, so the reduction order depends on the shape only. bench/knob_sweep.py
# on the H200 (session 15, bench/results/h200-session15d-sweep.log, S=16384): 16 x 256 at 4 warps, 0.183 ms (68% of
# copy); 8 warps (the first default) 0.211 ms; the fastest timed, 32 x 256 at 4 warps, 0.173 ms. Session 15 kept 16
# rows for spills that were an artefact of compiling without the JIT's alignment attributes: with them (ptxas sm_90,
# triton 3.9, 4 table rows) 16 x 256 takes 124 registers, 32 x 256 229, neither spills. Session 21 on an H100
# (bench/results/h100-session21-sweeps.log, S=16384, copy 3021 GB/s): 32 x 256 at 4 warps 0.224 ms (78%), 16 x 256
# 0.234 ms; 8 warps slower at every tile. 32 rows stay out: with fp32
# inputs that tile takes 255 registers and spills 120 bytes (tests/kernels/test_compile.py, triton 3.9). With the
# column block first in the grid (see _gated_bwd; session 23, bench/results/h100-session23b-gated.log, H100):
# 8 x 512 and 16 x 512 0.212 ms (83% of copy), 4 x 1024 0.214, 16 x 256 0.215, 32 x 256 0.217, 8 x 1024 0.221;
# 8 x 512 also won the first call of that session (0.212 against 0.215 at 16 x 256). It takes more registers (ptxas
# sm_90, triton 3.9, BLOCK_R 16, bf16: 209 against 128; the [table rows, columns] accumulator doubles), so two programs
# fit an SM, not four, and it is still the fastest.
GATED_BLOCK_H = 512
GATED_WARPS = 4
GATED_TILE_S = 32 if is_interpreting() else 8
GATED_CHUNKS = 4 if is_interpreting() else 64
# A prefetch of the next tile before the current tile's math (two tiles' loads in flight, as norm.py's backwards do)
# was written and dropped: 167 registers at 16 x 256 (three programs per SM, not four), and on an H100 it lost or tied
# at every tile, warps and chunk count timed (sessions 21 and 22: 0.242 against 0.234 ms at 16 x 256).
# Above 1: the one-table-row chunks' tile loop (the hot path) is a tl.range of that many stages, whose loads Triton
# pipelines through shared memory rather than registers (session 27, not yet timed; registers: bench/RESULTS.md).
GATED_STAGES = 1


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _gated_fwd_kernel(x_ptr, b_ptr, tab_ptr, idx_ptr, y_ptr, S, H, tab_stride, gate_off,
                      BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < S
    m2 = rmask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    # Upcast at load: the product and the sum in fp32, one rounding at the store.
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    ix = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    gate = tl.load(tab_ptr + ix[:, None] * tab_stride + gate_off + cols[None, :], mask=m2, other=0.0)
    y = x + gate.to(tl.float32) * b
    tl.store(y_ptr + offs, cast_rne(y, y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gated_bwd_tile(dy_raw, b_raw, db_ptr, gate, rows, cols, S, H, NEED_DB: tl.constexpr):
    """dy * branch of tiles `dy_raw`, `b_raw` (rows `rows`, load_row_pair) in fp32; stores d_branch = dy * gate
    (NEED_DB).

    gate: fp32 [TILE_S, BLOCK_H] (the rows' gates) or [1, BLOCK_H] (one gate row for all of them).
    """
    dy = dy_raw.to(tl.float32)
    if NEED_DB:
        m2 = (rows < S)[:, None] & (cols < H)[None, :]
        tl.store(db_ptr + rows[:, None] * H + cols[None, :], cast_rne(dy * gate, db_ptr.dtype.element_ty), mask=m2)
    return dy * b_raw.to(tl.float32)  # fp32 products, never rounded before the table-row sums


@triton.jit
def _gated_bwd_kernel(dy_ptr, b_ptr, tab_ptr, idx_ptr, db_ptr, part_ptr, S, H, R, tab_stride, gate_off,
                      NEED_DB: tl.constexpr, CHUNK_S: tl.constexpr, TILE_S: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    pid_c = tl.program_id(1)  # the column block is axis 0 (see _gated_bwd)
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    rids = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    start = pid_c * CHUNK_S
    end = tl.minimum(start + CHUNK_S, S)
    crow = chunk_row(idx_ptr, start, S, CHUNK_S)
    if crow >= 0:  # the whole chunk is one table row: one gate row, elementwise adds, one reduction at the end
        gate = tl.zeros([1, BLOCK_H], dtype=tl.float32)
        if NEED_DB:
            gate = tl.load(tab_ptr + crow.to(tl.int64) * tab_stride + gate_off + cols, mask=cmask, other=0.0)
            gate = gate.to(tl.float32)[None, :]
        run = tl.zeros([TILE_S, BLOCK_H], dtype=tl.float32)
        for t in tl.range(0, CHUNK_S, TILE_S, num_stages=STAGES):
            t0 = start + t
            dy_raw, b_raw = load_row_pair(dy_ptr, b_ptr, t0, end, cols, cmask, H, TILE_S)
            run += _gated_bwd_tile(dy_raw, b_raw, db_ptr, gate, t0 + tl.arange(0, TILE_S), cols, S, H, NEED_DB)
        acc = add_row(acc, tl.sum(run, axis=0), crow, rids)
    else:
        for t in range(0, CHUNK_S, TILE_S):
            t0 = start + t
            rows = t0 + tl.arange(0, TILE_S)
            ix = load_ix(idx_ptr, rows, S)
            gate = tl.zeros([TILE_S, BLOCK_H], dtype=tl.float32)
            if NEED_DB:
                gate = tl.load(tab_ptr + ix.to(tl.int64)[:, None] * tab_stride + gate_off + cols[None, :],
                               mask=(rows < S)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            dy_raw, b_raw = load_row_pair(dy_ptr, b_ptr, t0, end, cols, cmask, H, TILE_S)
            dyb = _gated_bwd_tile(dy_raw, b_raw, db_ptr, gate, rows, cols, S, H, NEED_DB)
            acc = add_tile(acc, dyb, ix, uniform_row(ix), rids, R)
    offs_p = pid_c * R * H + rids[:, None] * H + cols[None, :]
    tl.store(part_ptr + offs_p, acc, mask=(rids[:, None] < R) & cmask[None, :])


@triton.jit
def _add_kernel(x_ptr, b_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, cast_rne(x + b, y_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------- launchers


def _elem_plan(S: int, H: int) -> tuple[int, int, tuple[int, int]]:
    block_h = min(triton.next_power_of_2(H), ELEM_MAX_BLOCK_H)
    block_s = max(1, ELEM_TILE // block_h)
    return block_s, block_h, (triton.cdiv(S, block_s), triton.cdiv(H, block_h))


def _gated_fwd(x, branch, table, idx, gate_off):
    S, H = x.shape
    y = new_empty((S, H), x.dtype, x.device)
    block_s, block_h, grid = _elem_plan(S, H)
    _gated_fwd_kernel[grid](x, branch, table, idx, y, S, H, table.stride(0), gate_off,
                            BLOCK_S=block_s, BLOCK_H=block_h, num_warps=4)
    return y


def bwd_plan(S: int, R: int) -> tuple[int, int, int, int]:
    """(CHUNK_S, TILE_S, BLOCK_R, NC) of the backward's table-gradient sums over S rows into R table rows."""
    return plan_segments(S, R, GATED_TILE_S, GATED_CHUNKS)


def _gated_bwd(dy, branch, table, idx, gate_off, need_db, need_t):
    S, H = branch.shape
    R = table.shape[0]
    chunk, tile, block_r, nc = bwd_plan(S, R)
    db = new_empty((S, H), branch.dtype, branch.device) if need_db else None
    partials = new_empty((nc, R, H), torch.float32, branch.device)
    # The column block is the grid's first (fastest-launched) axis, so the programs resident together read whole rows
    # of a few chunks, not one GATED_BLOCK_H-column slice of many chunks' rows (the same programs and sums, same bytes).
    # On an H100 at S=16384 (session 23, bench/results/h100-session23-sweeps.log, copy 3022 GB/s) this order ran the
    # backward in 0.212-0.217 ms (81-83% of copy) at 8 x 512, 16 x 256 and 32 x 256 against 0.224-0.244 ms (72-78%)
    # with the row chunk first.
    grid = (triton.cdiv(H, GATED_BLOCK_H), nc)
    _gated_bwd_kernel[grid](dy, branch, table, idx, db if need_db else partials, partials, S, H, R, table.stride(0),
                            gate_off, NEED_DB=need_db, CHUNK_S=chunk, TILE_S=tile, BLOCK_H=GATED_BLOCK_H,
                            BLOCK_R=block_r, STAGES=GATED_STAGES, num_warps=GATED_WARPS)
    d_table = None
    if need_t:
        # Chunks other than the gate get exact zeros (this op does not read them), written by the finish.
        d_table = new_empty(tuple(table.shape), table.dtype, table.device)
        finish_segments(partials, d_table, col_offset=gate_off, zero_rest=True)
    return db, d_table


def _add(x, branch):
    y = new_empty(x.shape, x.dtype, x.device)
    n = x.numel()
    _add_kernel[(triton.cdiv(n, ADD_BLOCK),)](x, branch, y, n, BLOCK=ADD_BLOCK, num_warps=4)
    return y


# ----------------------------------------------------------------------------------------------- autograd


class GatedResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, branch, table, idx, gate_off):
        ctx.save_for_backward(branch, table, idx)
        ctx.gate_off = gate_off
        return _gated_fwd(x, branch, table, idx, gate_off)

    @staticmethod
    def backward(ctx, dy):
        branch, table, idx = ctx.saved_tensors
        need = ctx.needs_input_grad
        db, dt = (None, None)
        if need[1] or need[2]:
            db, dt = _gated_bwd(dy.contiguous(), branch, table, idx, ctx.gate_off, need[1], need[2])
        return dy if need[0] else None, db, dt, None, None


class ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, branch):
        return _add(x, branch)

    @staticmethod
    def backward(ctx, dy):
        return dy, dy


# ----------------------------------------------------------------------------------------------- functional


def _check_pair(op: str, x: torch.Tensor, branch: torch.Tensor, *extra) -> torch.device:
    dev = check_inputs(op, ("x", x), ("branch", branch), *extra)
    if branch.dtype != x.dtype:
        raise KernelInputError(f"{op}: `branch` has dtype {branch.dtype}, `x` has {x.dtype}; they must match")
    check_shape(op, "branch", branch, tuple(x.shape))
    return dev


def gated_residual(x_SH: torch.Tensor, branch_SH: torch.Tensor, table_RKH: torch.Tensor, idx_S: torch.Tensor,
                   gate_chunk: int) -> torch.Tensor:
    """x + table[idx, gate_chunk] * branch in fp32, one rounding."""
    op = "gated_residual"
    dev = _check_pair(op, x_SH, branch_SH, ("table", table_RKH))
    check_shape(op, "x", x_SH, (-1, -1))
    check_shape(op, "table", table_RKH, (-1, -1))
    S, H = x_SH.shape
    R, width = table_RKH.shape
    if width % H:
        raise KernelInputError(f"{op}: table width {width} is not a multiple of H={H}")
    check_chunk(op, "gate_chunk", gate_chunk, width // H)
    check_index(op, "idx", idx_S, S, R, dev)
    return GatedResidual.apply(x_SH, branch_SH, table_RKH, idx_S, gate_chunk * H)


def residual_add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """x + branch in fp32, one rounding (a named kernel so the binding can count it)."""
    _check_pair("residual_add", x, branch)
    return ResidualAdd.apply(x, branch)


__all__ = ["gated_residual", "residual_add"]
