"""Full non-causal softmax attention for MiniMax-H3, forward and backward (FlashAttention-2 scheme in Triton).

Contract
    o[b, i, h, :] = sum_j softmax_j(q[b, i, h, :] . k[b, j, h, :] * scale) * v[b, j, h, :],  scale = 1 / sqrt(D)
    over one packed, unmasked document per batch item (MiniMax-H3 passes no attention mask).

Shapes and layout
    q_BSND, k_BSND, v_BSND -> o_BSND: the [B, S, NH, D] layout diffusers' ``dispatch_attention_fn`` receives and
    returns. Read through strides, never transposed or copied; only the last dim must be contiguous. Where the
    table asks for it (AttnConfig.*_tma) and the tensors are 16-byte aligned, each loop's streamed tiles come
    through TMA tensor descriptors over the same strided [B, S, NH, D] views.
    D in {32, 64, 128}; any S >= 1 (tail tiles are masked); B >= 1.

Dtypes and accumulation
    bfloat16 or float32 inputs, all three alike; o and dq/dk/dv have the input dtype. Scores, softmax statistics
    and every accumulator are float32. bf16 tiles go to ``tl.dot`` as bf16 (probabilities and dS are rounded to
    bf16 before their dot, as FlashAttention does); float32 tiles use an IEEE float32 dot (no TF32).
    The forward saves the base-2 logsumexp lse_BNS (float32) for the backward.

Backward
    delta = rowsum(dO * O) (preprocess kernel), then dK/dV over key blocks and dQ over query blocks in two
    separate kernels (S^T and dP^T are recomputed in both: 7 S x S x D matmuls instead of 5, the price of writing
    dQ without float atomics). Results are deterministic and byte-identical run to run.

Fused dQ (AttnConfig.dq_fused, bfloat16 only; off by default: on an H100 at S=16384 its backward ran at 194 TFLOP/s
    against the separate kernels' 413, bench/RESULTS.md session 17): 5 matmuls. Each dK/dV program adds its share
    of every query row's dQ, rounded to a fixed-point integer, into int32 accumulators with atomics; integer sums
    do not depend on the order the adds land in, so results stay byte-identical. Row i's unit is bound_i / 2**30 with
    bound_i = 2 |dO_i|_2 max_j |v_j|_2 max_{j,d} |k_jd| (per batch and head), which bounds the sum of the absolute
    shares: sum_j |dS_ij| <= max_j |dP_ij| + |delta_i| <= 2 |dO_i| max_j |v_j|. No sum can overflow (half the int32
    range is headroom for the bf16 rounding of dS) and each share is off by at most half a unit, so dq_i's added
    error is at most 2**-30 * ceil(S / dkdv_n) / 2 of bound_i: at S=16384, 6e-8 * over_i of max_d |dq_id|, where
    over_i = bound_i / (sqrt(D) max_d |dq_id|). bench/fused_dq_error.py measures over_i (randn, S=4096: median
    1.9e3), so the worst case stays well below dq's one bf16 rounding (2**-9) while over_i < ~3e4. A finish kernel
    scales the sums back (times 1/sqrt(D)) and rounds them to bf16. float32 keeps the separate dQ kernel: the fixed
    point would be coarser than its IEEE accumulation.

Rejected (KernelInputError, a ValueError, message names the op)
    non-tensors, ndim != 4, empty tensors, q/k/v differing in shape, dtype or device, dtypes other than
    bfloat16/float32, D outside {32, 64, 128}, a non-contiguous last dim, CPU tensors without TRITON_INTERPRET=1,
    B * NH > 65535 (grid limit), per-(batch, head) spans beyond int32 offsets.

Legend of shape suffixes: B batch, S sequence, NH heads, D head dim; kernels tile S into M (query) and N (key) rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from triton.tools.tensor_descriptor import TensorDescriptor

from h3kernels._common import KernelInputError, cast_rne, is_interpreting, new_empty

# ---------------------------------------------------------------------------------------------------------------------
# Tuned constants: spill-free starting points, to be retuned for speed on the H200 with bench/attention.py. Override any
# field without editing this file: H3KERNELS_ATTN_CONFIG="fwd_m=128,fwd_n=128,fwd_warps=8" (applies to every D/dtype),
# or pass ``config=AttnConfig(...)`` to ``attention``.
# ---------------------------------------------------------------------------------------------------------------------
_FLAG_FIELDS = ("dkdv_dp_first", "dq_dp_first", "fwd_tma", "dkdv_tma", "dq_tma", "dq_fused")


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    fwd_m: int  # query rows per forward program
    fwd_n: int  # key rows per forward loop step
    fwd_warps: int
    fwd_stages: int
    dkdv_m: int  # query rows per dK/dV loop step
    dkdv_n: int  # key rows per dK/dV program (its dk/dv accumulators are dkdv_n x D fp32)
    dkdv_warps: int
    dkdv_stages: int
    dq_m: int  # query rows per dQ program (its dq accumulator is dq_m x D fp32)
    dq_n: int  # key rows per dQ loop step
    dq_warps: int
    dq_stages: int
    # 1: the kernel issues both score-sized dots (S^T and dP^T, or S and dP) before the softmax maths, which lets
    # Triton keep the dK/dV accumulating dots asynchronous across loop steps on Hopper (wgmma; seen in the sm_90
    # TTGIR); 0: the FlashAttention-2 tutorial order (S, P, dV, then dP), whose dV dot waits at once. Same
    # arithmetic either way, so results are byte-identical across this flag.
    dkdv_dp_first: int = 1
    dq_dp_first: int = 1
    # 1: the tiles the kernel's loop streams (k/v in the forward and dQ, q/dO in dK/dV) are read through TMA tensor
    # descriptors over the [B, S, NH, D] tensors (Hopper's copy engine: no per-thread address maths, tail rows
    # zero-filled by the hardware) when those tensors are 16-byte aligned (see _tma_ready); 0, or unaligned
    # tensors: masked pointer loads. The same values land in the tiles, so results are byte-identical either way.
    fwd_tma: int = 0
    dkdv_tma: int = 0
    dq_tma: int = 0
    # 1 (bfloat16 only): the dK/dV kernel also computes each tile pair's dQ share (dS^T K, the fifth matmul) and adds
    # it with integer atomics into an int32 fixed-point accumulator, so the separate dQ kernel (and its recomputed S
    # and dP) is not launched. Integer adds commute, so the sum is byte-identical run to run whatever order the
    # atomics land in. The dq_* fields are then unused. See "Fused dQ" in the module docstring for the scaling.
    dq_fused: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            flag = f.name in _FLAG_FIELDS
            if not isinstance(val, int) or val < (not flag) or (flag and val > 1):
                need = "0 or 1" if flag else "a positive int"
                raise KernelInputError(f"attention: config {f.name}={val!r} must be {need}")
            if f.name.endswith(("_m", "_n")) and (val < 16 or val & (val - 1)):
                raise KernelInputError(f"attention: config {f.name}={val} must be a power of two >= 16 (tl.dot)")


# Picked by compiling every kernel for sm_90 on a CPU machine (triton 3.9 + ptxas: `python bench/attention.py
# --compile-only --table`, run by tests/kernels/test_attention.py::test_kernels_compile_for_sm90_without_spills) and
# keeping spill-free tiles, starting from the Triton fused-attention tutorial's 128x64 forward and 32x128 / 128x32
# backward tiles. Those first compiles lacked the 16-byte alignment hints real launches get, so they saw unpipelined
# tile loads and inflated registers (dK/dV 32x64/8 warps: 255 then, 164 with the hints), and the bf16 D=128 backward
# tiles below are conservative: bench/attention_sweep.txt lists spill-free candidates to time on the H200, and
# `python3 bench/attention.py --sweep bench/attention_sweep.txt` prints the winner as a line for this table.
# Registers/thread with hints, bf16 D=128: fwd 128x64/8 warps 177; dK/dV 32x64/8 warps 164 (32x128: 234; 64x128
# spills: dk+dv alone are 2 x 128x128 fp32 = 128 registers/thread at 8 warps); dQ 64x64/4 warps 166 (128x64/8: 172).
# bf16 D<=64: the tutorial tiles at 8 warps. fp32 (IEEE dot on FMA units, an accuracy path): small tiles, whose
# register use jumps erratically with the FMA layouts, so each D keeps a variant that does not spill.
# Stages: 3 for bf16 (K/V double-buffering plus one), 2 for the larger-per-element fp32 tiles.
_BF16_SMALL_D = AttnConfig(128, 64, 8, 3, 32, 128, 8, 3, 128, 32, 8, 3)
CONFIGS: dict[tuple[int, torch.dtype], AttnConfig] = {
    # Backward tiles: the winner of `bench/attention.py --sweep bench/attention_sweep.txt` on the H200
    # (2026-12-02, session 2): 393 TFLOP/s backward at S=16384, was 200 with (32x64/8/3, 64x64/4/3). The forward's
    # pointer-load tiles were swept in session 12 (bench/attention_sweep_fwd.txt): none beat 128x64/8/3. TMA loads
    # (bench/attention_sweep_tma.txt, session 14) let the forward take 128-key steps (194 registers, 233 without
    # TMA) and sped up dQ's streamed K/V; dK/dV ran slower with them (32.8 vs 30.3 ms) and keeps pointer loads.
    # At S=16384, 40 iterations: fwd 15.73 ms (was 16.10), bwd 47.91 (was 48.34); bench/RESULTS.md, session 14.
    (128, torch.bfloat16): AttnConfig(128, 128, 8, 3, 32, 128, 8, 4, 128, 64, 8, 4, 1, 1, fwd_tma=1, dq_tma=1),
    (64, torch.bfloat16): _BF16_SMALL_D,
    (32, torch.bfloat16): _BF16_SMALL_D,
    (128, torch.float32): AttnConfig(64, 32, 8, 2, 32, 32, 8, 2, 32, 16, 8, 2),
    (64, torch.float32): AttnConfig(64, 32, 8, 2, 32, 32, 8, 2, 32, 32, 4, 2),
    (32, torch.float32): AttnConfig(64, 32, 8, 2, 16, 64, 8, 2, 32, 16, 8, 2),
}
CONFIG_ENV = "H3KERNELS_ATTN_CONFIG"
_DELTA_M = 64  # rows per delta-preprocess (and fused-dQ finish) program: memory-bound, the tile barely matters
DQ_FIX_ONE = 2.0**30  # fused dQ: a row's bound in fixed-point units (half the int32 range: headroom)
_LOG2E = 1.4426950408889634


def resolve_config(D: int, dtype: torch.dtype, override: str | None = None) -> AttnConfig:
    """The table entry for (D, dtype) with ``override`` (default: $H3KERNELS_ATTN_CONFIG) fields replaced."""
    cfg = CONFIGS[(D, dtype)]
    spec = os.environ.get(CONFIG_ENV, "") if override is None else override
    fields = {f.name for f in dataclasses.fields(AttnConfig)}
    changes: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        if key.strip() not in fields or not val.strip().isdigit():
            raise KernelInputError(f"attention: bad config item {item!r} in {spec!r}; fields: {sorted(fields)}")
        changes[key.strip()] = int(val)
    return dataclasses.replace(cfg, **changes)


# triton.jit builds CPU-interpreter kernels when TRITON_INTERPRET is set at decoration time, i.e. when this module is
# imported; read it at the same moment so the UPCAST switch always matches the kind of kernel that runs.
_INTERPRET = is_interpreting()


# ---------------------------------------------------------------------------------------------------------------------
# Kernels. UPCAST is on only under TRITON_INTERPRET=1: the interpreter computes bf16 arithmetic (tl.dot included) on
# raw uint16 bits and gets garbage (triton issue 11584), so loaded tiles are widened to fp32 before any dot there.
# Rounded operands (p, dS) and outputs are still rounded to nearest-even in the input dtype (cast_rne), so the CPU path
# rounds exactly where and how the GPU does; bf16 x bf16 products are exact in fp32, so only summation order differs.
# ---------------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, mask, UPCAST: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _head_base(X, b, h, s_b, s_h, TMA: tl.constexpr):
    # Where (batch b, head h) of a [B, S, NH, D] operand starts: a pointer, or the tensor descriptor itself (its
    # loads take (b, row, h, 0) coordinates).
    if TMA:
        base = X
    else:
        base = X + b * s_b + h * s_h
    return base


@triton.jit
def _load_rows(base, b, h, row0, s_s, S, BLOCK: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr,
               UPCAST: tl.constexpr):
    # Rows row0 .. row0 + BLOCK - 1 (all D columns) of one (batch, head); rows at or past S read as 0, from the mask
    # or from TMA's out-of-bounds zero fill.
    if TMA:
        x = base.load([b.to(tl.int32), row0, h.to(tl.int32), 0]).reshape(BLOCK, D)
        if UPCAST:
            x = x.to(tl.float32)
    else:
        offs = row0 + tl.arange(0, BLOCK)
        x = _load_tile(base + offs[:, None] * s_s + tl.arange(0, D)[None, :], (offs < S)[:, None], UPCAST)
    return x


@triton.jit
def _program_rows(NH, S, BLOCK: tl.constexpr, D: tl.constexpr):
    # Grid (row blocks, B * NH): this program's (batch, head) index bh = b * NH + h, its BLOCK sequence rows, the D
    # columns and which rows are real (< S). int64 bh: batch offsets of [B, S, NH, D] can pass 2**31 elements.
    bh = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh, bh // NH, bh % NH, offs, tl.arange(0, D), offs < S


@triton.jit
def _round(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 p or dS rounded to nearest-even in the input dtype: the bf16 tensor-core fast path (a no-op for fp32).
    # Under UPCAST widened back to fp32 (exactly, the value is a bf16 one) since the interpreter's bf16 dot is broken.
    x = cast_rne(x, DTYPE)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_tile(ptrs, x, mask):
    tl.store(ptrs, cast_rne(x, ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _attn_fwd_kernel(Q, K, V, Out, LSE, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                     NH, S, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     TAIL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    bh, b, h, offs_m, offs_d, in_m = _program_rows(NH, S, BLOCK_M, D)
    q = _load_tile(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], in_m[:, None], UPCAST)
    k_base = _head_base(K, b, h, sk_b, sk_h, TMA)
    v_base = _head_base(V, b, h, sv_b, sv_h, TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, S, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_n = offs_n < S
        k = _load_rows(k_base, b, h, start_n, sk_s, S, BLOCK_N, D, TMA, UPCAST)
        # Scores in base 2 (scale * log2(e) folded in) so exp2 is a single MUFU op; tail keys get -inf so they get
        # zero weight (TAIL: S % BLOCK_N != 0, else the select is compiled out). Every key block holds at least one
        # real key, so m_new stays finite and alpha never is NaN.
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if TAIL:
            s = tl.where(in_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, b, h, start_n, sv_s, S, BLOCK_N, D, TMA, UPCAST)
        acc = tl.dot(_round(p, Out.dtype.element_ty, UPCAST), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]  # l_i >= 1: the row max contributes exp2(0)
    _store_tile(Out + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], acc, in_m[:, None])
    tl.store(LSE + bh * S + offs_m, m_i + tl.math.log2(l_i), mask=in_m)


@triton.jit
def _attn_bwd_delta_kernel(Out, DO, DELTA, VK, BOUND, so_b, so_s, so_h, sdo_b, sdo_s, sdo_h, NH, S, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, FUSED_DQ: tl.constexpr):
    bh, b, h, offs_m, offs_d, in_m = _program_rows(NH, S, BLOCK_M, D)
    # fp32 products and row sum: delta feeds dS = P * (dP - delta), a difference of near-equal terms.
    o = tl.load(Out + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=in_m[:, None], other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=in_m[:, None],
                 other=0.0)
    do = do.to(tl.float32)
    delta = tl.sum(o.to(tl.float32) * do, 1)
    tl.store(DELTA + bh * S + offs_m, delta, mask=in_m)
    if FUSED_DQ:
        # The fixed-point bound of dq's rows: 2 |dO_i| times max |v_j| * max |k| of this (batch, head). + 0 * delta
        # makes it NaN where o_i is not finite (a NaN q_i reaches dq only through p, whose NaN the integer
        # conversion would drop), so a non-finite dq row stays non-finite.
        bound = 2.0 * tl.sqrt(tl.sum(do * do, 1)) * tl.load(VK + bh) + 0.0 * delta
        tl.store(BOUND + bh * S + offs_m, bound, mask=in_m)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQACC, BOUND, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b,
                          sv_s, sv_h, sdo_b, sdo_s, sdo_h, sg_b, sg_s, sg_h, NH, S, qk_scale, sm_scale, fix_one,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr,
                          TAIL_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, DP_FIRST: tl.constexpr,
                          TMA: tl.constexpr, FUSED_DQ: tl.constexpr):
    # One program owns BLOCK_N keys of one (batch, head) and sweeps all queries: dV = P^T dO, dK = scale dS^T Q.
    # FUSED_DQ: also dQ^T += K^T dS^T per query block, added in fixed point to DQACC ([B*NH, D, S] int32, queries
    # contiguous so each atomic row is coalesced) in units of BOUND / fix_one per query row.
    bh, b, h, offs_n, offs_d, in_n = _program_rows(NH, S, BLOCK_N, D)
    k = _load_tile(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], in_n[:, None], UPCAST)
    v = _load_tile(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], in_n[:, None], UPCAST)
    q_base = _head_base(Q, b, h, sq_b, sq_h, TMA)
    do_base = _head_base(DO, b, h, sdo_b, sdo_h, TMA)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for start_m in range(0, S, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_m = offs_m < S
        q = _load_rows(q_base, b, h, start_m, sq_s, S, BLOCK_M, D, TMA, UPCAST)
        do = _load_rows(do_base, b, h, start_m, sdo_s, S, BLOCK_M, D, TMA, UPCAST)
        lse = tl.load(LSE + bh * S + offs_m, mask=in_m, other=0.0)
        delta = tl.load(DELTA + bh * S + offs_m, mask=in_m, other=0.0)
        # P^T recomputed from the saved base-2 logsumexp; tail queries zeroed (TAIL: S % BLOCK_M != 0). Tail keys
        # (rows of k are 0) may give large pT, but rows of dk/dv are independent and tail rows are never stored.
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)
        if DP_FIRST:  # constexpr: see AttnConfig.dp_first
            dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if TAIL:
            pT = tl.where(in_m[None, :], pT, 0.0)
        dv = tl.dot(_round(pT, DV.dtype.element_ty, UPCAST), do, dv, input_precision=PREC)
        if not DP_FIRST:
            dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        if FUSED_DQ and TAIL_N:  # tail keys (S % BLOCK_N != 0) may hold inf p; their k rows are 0, inf * 0 = NaN
            dsT = tl.where(in_n[:, None], dsT, 0.0)
        dsT = _round(dsT, DK.dtype.element_ty, UPCAST)
        dk = tl.dot(dsT, q, dk, input_precision=PREC)
        if FUSED_DQ:
            dqT = tl.dot(tl.trans(k), dsT, input_precision=PREC)  # [D, BLOCK_M]: this key block's share
            bound = tl.load(BOUND + bh * S + offs_m, mask=in_m, other=0.0)
            # bound 0: dO_i, V or K is 0, so is dq_i; not > 0 also takes NaN bounds (then the finish gives NaN)
            per_unit = tl.where(bound > 0.0, fix_one / tl.where(bound > 0.0, bound, 1.0), 0.0)
            units = dqT * per_unit[None, :]
            units = tl.where(units >= 0.0, units + 0.5, units - 0.5).to(tl.int32)  # nearest, ties away from 0
            tl.atomic_add(DQACC + bh * D * S + offs_d[:, None] * S + offs_m[None, :], units, mask=in_m[None, :],
                          sem="relaxed")
    dk = dk * sm_scale
    g_off = b * sg_b + h * sg_h + offs_n[:, None] * sg_s + offs_d[None, :]  # dk and dv share one layout
    _store_tile(DK + g_off, dk, in_n[:, None])
    _store_tile(DV + g_off, dv, in_n[:, None])


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                        sdo_b, sdo_s, sdo_h, sg_b, sg_s, sg_h, NH, S, qk_scale, sm_scale, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr, UPCAST: tl.constexpr,
                        PREC: tl.constexpr, DP_FIRST: tl.constexpr, TMA: tl.constexpr):
    # One program owns BLOCK_M queries of one (batch, head) and sweeps all keys: dQ = scale dS K.
    bh, b, h, offs_m, offs_d, in_m = _program_rows(NH, S, BLOCK_M, D)
    q = _load_tile(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], in_m[:, None], UPCAST)
    do = _load_tile(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], in_m[:, None], UPCAST)
    lse = tl.load(LSE + bh * S + offs_m, mask=in_m, other=0.0)
    delta = tl.load(DELTA + bh * S + offs_m, mask=in_m, other=0.0)
    k_base = _head_base(K, b, h, sk_b, sk_h, TMA)
    v_base = _head_base(V, b, h, sv_b, sv_h, TMA)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, S, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_n = offs_n < S
        k = _load_rows(k_base, b, h, start_n, sk_s, S, BLOCK_N, D, TMA, UPCAST)
        v = _load_rows(v_base, b, h, start_n, sv_s, S, BLOCK_N, D, TMA, UPCAST)
        # Tail keys must get exactly zero probability here (TAIL: S % BLOCK_N != 0): they would feed real query rows.
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if DP_FIRST:
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if TAIL:
            p = tl.where(in_n[None, :], p, 0.0)
        if not DP_FIRST:
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(_round(ds, DQ.dtype.element_ty, UPCAST), k, dq, input_precision=PREC)
    dq = dq * sm_scale
    _store_tile(DQ + b * sg_b + h * sg_h + offs_m[:, None] * sg_s + offs_d[None, :], dq, in_m[:, None])


@triton.jit
def _attn_bwd_dq_finish_kernel(DQACC, BOUND, DQ, sg_b, sg_s, sg_h, NH, S, unit_scale, D: tl.constexpr,
                               BLOCK_M: tl.constexpr):
    # dq = the fused dQ's fixed-point sums times their unit (bound / fix_one) times 1/sqrt(D), rounded once.
    bh, b, h, offs_m, offs_d, in_m = _program_rows(NH, S, BLOCK_M, D)
    units = tl.load(DQACC + bh * D * S + offs_d[:, None] * S + offs_m[None, :], mask=in_m[None, :], other=0)
    bound = tl.load(BOUND + bh * S + offs_m, mask=in_m, other=0.0)
    dqT = units.to(tl.float32) * (bound * unit_scale)[None, :]
    _store_tile(DQ + b * sg_b + h * sg_h + offs_m[None, :] * sg_s + offs_d[:, None], dqT, in_m[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# Launchers: validate, allocate (new_empty: NaN-filled inside _common.poisoned_outputs()), launch.
# ---------------------------------------------------------------------------------------------------------------------
def check_attention_inputs(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> None:
    """Raise KernelInputError with the actual shapes/dtypes/devices when the kernels cannot take these inputs."""
    named = {"q": q_BSND, "k": k_BSND, "v": v_BSND}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise KernelInputError(f"attention: {name} must be [B, S, NH, D], got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise KernelInputError(f"attention: {name} is empty, shape {tuple(t.shape)}")
    desc = ", ".join(f"{n} {tuple(t.shape)} {t.dtype} {t.device}" for n, t in named.items())
    if not (q_BSND.shape == k_BSND.shape == v_BSND.shape):
        raise KernelInputError(f"attention: q/k/v shapes differ: {desc}")
    if not (q_BSND.dtype == k_BSND.dtype == v_BSND.dtype):
        raise KernelInputError(f"attention: q/k/v dtypes differ: {desc}")
    if not (q_BSND.device == k_BSND.device == v_BSND.device):
        raise KernelInputError(f"attention: q/k/v devices differ: {desc}")
    B, S, NH, D = q_BSND.shape
    if q_BSND.dtype not in (torch.bfloat16, torch.float32):
        raise KernelInputError(f"attention: dtype {q_BSND.dtype} unsupported (bfloat16 or float32): {desc}")
    if D not in (32, 64, 128):
        raise KernelInputError(f"attention: head dim D={D} unsupported (32, 64 or 128): {desc}")
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise KernelInputError(f"attention: {name} last dim must be contiguous, strides {t.stride()}")
        if (S - 1) * t.stride(1) + D > 2**31 - 1:
            raise KernelInputError(f"attention: {name} per-(batch, head) span overflows int32, strides {t.stride()}")
    if q_BSND.device.type != "cuda" and not (q_BSND.device.type == "cpu" and _INTERPRET):
        raise KernelInputError(f"attention: needs CUDA tensors (or CPU with TRITON_INTERPRET=1): {desc}")
    if B * NH > 65535:
        raise KernelInputError(f"attention: B*NH={B * NH} exceeds the 65535 grid limit: {desc}")


def _max_norm_products(k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
    """max_j |v_j|_2 * max_{j,d} |k_jd| per (batch, head), float32 [B, NH]: the head's part of the fused dQ bound."""
    v_max = torch.linalg.vector_norm(v_BSND, dim=-1, dtype=torch.float32).amax(dim=1)
    k_max = torch.maximum(k_BSND.amax(dim=(1, 3)), k_BSND.amin(dim=(1, 3)).neg()).float()
    return (v_max * k_max).contiguous()


def _launch_flags(dtype: torch.dtype) -> dict[str, object]:
    # IEEE fp32 dot for fp32 inputs (Triton defaults to TF32, ~1e-3 error); 16-bit operands ignore the flag.
    return {"UPCAST": _INTERPRET, "PREC": "ieee" if (dtype == torch.float32 or _INTERPRET) else "tf32"}


def _s3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _tma_ready(flag: int, *tensors: torch.Tensor) -> bool:
    # The TMA unit needs 16-byte aligned base addresses and strides (the last dim is contiguous, checked earlier).
    return bool(flag) and all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def _operand(t: torch.Tensor, rows: int, tma: bool) -> object:
    # A streamed operand: the tensor itself, or a [B, S, NH, D] descriptor whose loads are `rows` sequence positions
    # of one head. Resident tiles (loaded once per program) stay pointer loads: a descriptor-loaded tile is reshaped
    # in registers there, which costs the dK/dV kernel ~20 registers and spills it (sm_90 compile).
    return TensorDescriptor.from_tensor(t, [1, rows, 1, t.shape[-1]]) if tma else t


def attention_fwd(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor,
                  cfg: AttnConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launch: returns o_BSND (input dtype, contiguous) and lse_BNS (float32, base-2 logsumexp)."""
    B, S, NH, D = q_BSND.shape
    o_BSND = new_empty((B, S, NH, D), q_BSND.dtype, q_BSND.device)
    lse_BNS = new_empty((B, NH, S), torch.float32, q_BSND.device)
    tma = _tma_ready(cfg.fwd_tma, k_BSND, v_BSND)
    _attn_fwd_kernel[(triton.cdiv(S, cfg.fwd_m), B * NH)](
        q_BSND, _operand(k_BSND, cfg.fwd_n, tma), _operand(v_BSND, cfg.fwd_n, tma), o_BSND, lse_BNS,
        *_s3(q_BSND), *_s3(k_BSND), *_s3(v_BSND), *_s3(o_BSND), NH, S, _LOG2E / math.sqrt(D), D=D,
        BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, TAIL=S % cfg.fwd_n != 0, **_launch_flags(q_BSND.dtype), TMA=tma,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o_BSND, lse_BNS


def attention_bwd(do_BSND: torch.Tensor, q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor,
                  o_BSND: torch.Tensor, lse_BNS: torch.Tensor,
                  cfg: AttnConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launches: delta preprocess, dK/dV kernel, dQ kernel. Returns contiguous dq, dk, dv."""
    B, S, NH, D = q_BSND.shape
    if do_BSND.stride(-1) != 1 or do_BSND.dtype != q_BSND.dtype:
        # Autograd may hand an expanded (stride 0) or other-dtype gradient; the kernels read D-contiguous tiles.
        do_BSND = do_BSND.to(q_BSND.dtype).contiguous()
    fused = bool(cfg.dq_fused)
    delta_BNS = new_empty((B, NH, S), torch.float32, q_BSND.device)
    # Fused dQ: per-(batch, head) max |v_j|_2 * max |k| for the fixed-point bound, the int32 accumulator (zeroed:
    # the atomics add into it) and the per-row bound. Unfused, the kernels get placeholders they never touch.
    vk_BN = _max_norm_products(k_BSND, v_BSND) if fused else delta_BNS
    bound_BNS = new_empty((B, NH, S), torch.float32, q_BSND.device) if fused else delta_BNS
    dqacc_BNDS = torch.zeros((B, NH, D, S), dtype=torch.int32, device=q_BSND.device) if fused else delta_BNS
    _attn_bwd_delta_kernel[(triton.cdiv(S, _DELTA_M), B * NH)](
        o_BSND, do_BSND, delta_BNS, vk_BN, bound_BNS, *_s3(o_BSND), *_s3(do_BSND), NH, S, D=D, BLOCK_M=_DELTA_M,
        FUSED_DQ=fused)
    dq_BSND, dk_BSND, dv_BSND = (new_empty((B, S, NH, D), q_BSND.dtype, q_BSND.device) for _ in range(3))
    sm_scale = 1.0 / math.sqrt(D)
    strides = (*_s3(q_BSND), *_s3(k_BSND), *_s3(v_BSND), *_s3(do_BSND), *_s3(dq_BSND))  # dq, dk, dv: one layout
    flags = _launch_flags(q_BSND.dtype)
    tma = _tma_ready(cfg.dkdv_tma, q_BSND, do_BSND)
    _attn_bwd_dkdv_kernel[(triton.cdiv(S, cfg.dkdv_n), B * NH)](  # queries streamed, keys resident
        _operand(q_BSND, cfg.dkdv_m, tma), k_BSND, v_BSND, _operand(do_BSND, cfg.dkdv_m, tma), lse_BNS, delta_BNS,
        dk_BSND, dv_BSND, dqacc_BNDS, bound_BNS, *strides, NH, S, sm_scale * _LOG2E, sm_scale, DQ_FIX_ONE, D=D,
        BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, TAIL=S % cfg.dkdv_m != 0, TAIL_N=fused and S % cfg.dkdv_n != 0,
        DP_FIRST=bool(cfg.dkdv_dp_first), TMA=tma, FUSED_DQ=fused, **flags, num_warps=cfg.dkdv_warps,
        num_stages=cfg.dkdv_stages)
    if fused:
        _attn_bwd_dq_finish_kernel[(triton.cdiv(S, _DELTA_M), B * NH)](
            dqacc_BNDS, bound_BNS, dq_BSND, *_s3(dq_BSND), NH, S, sm_scale / DQ_FIX_ONE, D=D, BLOCK_M=_DELTA_M)
        return dq_BSND, dk_BSND, dv_BSND
    tma = _tma_ready(cfg.dq_tma, k_BSND, v_BSND)
    _attn_bwd_dq_kernel[(triton.cdiv(S, cfg.dq_m), B * NH)](  # queries resident, keys streamed
        q_BSND, _operand(k_BSND, cfg.dq_n, tma), _operand(v_BSND, cfg.dq_n, tma), do_BSND, lse_BNS, delta_BNS,
        dq_BSND, *strides, NH, S, sm_scale * _LOG2E, sm_scale, D=D, BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n,
        TAIL=S % cfg.dq_n != 0, DP_FIRST=bool(cfg.dq_dp_first), TMA=tma, **flags, num_warps=cfg.dq_warps,
        num_stages=cfg.dq_stages)
    return dq_BSND, dk_BSND, dv_BSND


# ---------------------------------------------------------------------------------------------------------------------
# Autograd Function, public op and its pure-torch reference.
# ---------------------------------------------------------------------------------------------------------------------
def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device, not the tensors' one: make them agree (multi-GPU hosts).
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BSND, k_BSND, v_BSND, cfg):  # noqa: ANN001, ANN205 (autograd signature)
        with _on_device(q_BSND):
            o_BSND, lse_BNS = attention_fwd(q_BSND, k_BSND, v_BSND, cfg)
        ctx.save_for_backward(q_BSND, k_BSND, v_BSND, o_BSND, lse_BNS)
        ctx.cfg = cfg
        return o_BSND

    @staticmethod
    @once_differentiable
    def backward(ctx, do_BSND):  # noqa: ANN001, ANN205
        q_BSND, k_BSND, v_BSND, o_BSND, lse_BNS = ctx.saved_tensors
        with _on_device(q_BSND):
            return (*attention_bwd(do_BSND, q_BSND, k_BSND, v_BSND, o_BSND, lse_BNS, ctx.cfg), None)


def attention(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor, *,
              config: AttnConfig | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per (batch, head) on [B, S, NH, D] tensors; differentiable in q, k and v."""
    check_attention_inputs(q_BSND, k_BSND, v_BSND)
    cfg = config if config is not None else resolve_config(q_BSND.shape[-1], q_BSND.dtype)
    if cfg.dq_fused and q_BSND.dtype != torch.bfloat16:
        raise KernelInputError(f"attention: dq_fused=1 needs bfloat16 inputs, got {q_BSND.dtype} (the fixed-point "
                               "dQ would be coarser than float32's IEEE accumulation)")
    return _AttentionFn.apply(q_BSND, k_BSND, v_BSND, cfg)


def attention_reference(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
    """The pure-torch reference: SDPA with the math backend, in the input dtype, same [B, S, NH, D] layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        o_BNSD = torch.nn.functional.scaled_dot_product_attention(
            q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2))
    return o_BNSD.transpose(1, 2)
