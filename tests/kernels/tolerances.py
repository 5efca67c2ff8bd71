"""One tolerance table for the h3kernels ops, keyed by (op, dtype, "out" | "grad" | "grad:<arg>").

Every comparison is against a float64 ground truth computed by `h3kernels.reference` on the same (already
rounded) inputs cast to float64. An element mismatches when |cand - truth| > atol * rms(truth) + rtol * |truth|:
atol is in units of the truth's RMS so one entry serves every shape and scale. A grad lookup falls back from
"grad:<arg>" to "grad".

For bfloat16 two checks apply: the elementwise bound (one round-to-nearest-even of an fp32 result is at most
2^-8 relative: half an ulp of an 8-bit significand), and `vs_ref`: the candidate's rel-L2 to float64 must be at
most `vs_ref` times that of the reference op run in bfloat16 (diffusers' own arithmetic). vs_ref = 1 is "at
least as close as diffusers"; the fp32-table ops must be far closer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float  # in units of rms(truth)
    rtol: float
    reason: str
    vs_ref: float | None = None  # bf16 only: candidate rel-L2 <= vs_ref * (bf16 reference op rel-L2)


BF16_RTOL = 2.0**-8 * 1.001  # one RNE rounding to bf16 (8-bit significand), plus slack for the fp32 math below it

FP32_ROW = Tol(1e-5, 1e-5, "fp32 math with one rounding: row sums of <= 8k terms stay ~1e-6 relative")
FP32_SUM = Tol(2e-5, 2e-5, "fp32 reduction over all S rows (segment/parameter sums): error grows with log S")
# vs_ref 1.01, not 1: where torch itself computes in fp32 and rounds once (its fused CPU rms_norm does), both
# sides give the same bf16 values but for rare fp32 last-bit differences at a rounding boundary.
BF16_ROW = Tol(1e-5, BF16_RTOL, "fp32 math, then one bf16 rounding; diffusers rounds as often or more", vs_ref=1.01)
BF16_FP32_OUT = Tol(1e-5, 1e-5, "fp32 output from bf16 inputs: no rounding at all, diffusers rounds to bf16",
                    vs_ref=0.05)

TOLERANCES: dict[tuple[str, str, str], Tol] = {
    # adaln_table: GEMV over E in fp32, the table stays fp32.
    ("adaln_table", "float32", "out"): FP32_ROW,
    ("adaln_table", "float32", "grad"): FP32_ROW,
    ("adaln_table", "bfloat16", "out"): Tol(1e-5, 1e-5, "fp32 table from bf16 weights; diffusers' table is bf16",
                                            vs_ref=0.05),
    ("adaln_table", "bfloat16", "grad:temb"): Tol(1e-5, 1e-5, "d_temb stays fp32 (temb is fp32); diffusers "
                                                  "rounds d_silu to bf16", vs_ref=0.05),
    ("adaln_table", "bfloat16", "grad"): Tol(1e-5, BF16_RTOL, "d_weight/d_bias: fp32 sum over T, one rounding to "
                                             "bf16 like diffusers' GEMM", vs_ref=1.01),
    # segment_sum: fp32 accumulation of fp32/bf16 values; diffusers accumulates in the table dtype.
    ("segment_sum", "float32", "out"): FP32_SUM,
    ("segment_sum", "float32", "grad"): Tol(0.0, 0.0, "a gather: exact"),
    ("segment_sum", "bfloat16", "out"): Tol(2e-5, 2e-5, "fp32 sums of bf16 values; diffusers' index_add sums in "
                                            "bf16", vs_ref=0.05),
    ("segment_sum", "bfloat16", "grad"): Tol(0.0, BF16_RTOL, "a gather of the fp32 grad, rounded once to bf16",
                                             vs_ref=1.0),
    # rms_norm / rms_norm_modulate: row statistics over H in fp32, one rounding.
    ("rms_norm", "float32", "out"): FP32_ROW,
    ("rms_norm", "float32", "grad"): FP32_ROW,
    ("rms_norm", "float32", "grad:weight"): FP32_SUM,
    ("rms_norm", "bfloat16", "out"): BF16_ROW,
    ("rms_norm", "bfloat16", "grad"): BF16_ROW,
    ("rms_norm_modulate", "float32", "out"): FP32_ROW,
    ("rms_norm_modulate", "float32", "grad"): FP32_ROW,
    ("rms_norm_modulate", "float32", "grad:weight"): FP32_SUM,
    ("rms_norm_modulate", "float32", "grad:table"): FP32_SUM,
    ("rms_norm_modulate", "bfloat16", "out"): BF16_ROW,
    ("rms_norm_modulate", "bfloat16", "grad"): BF16_ROW,
    ("rms_norm_modulate", "bfloat16", "grad:table"): Tol(2e-5, 2e-5, "fp32 table grad, fp32 sums; diffusers "
                                                         "scatter-adds bf16", vs_ref=0.05),
    # qk_norm_rope: per-head statistics over D, rotation in fp32 with fp32 cos/sin.
    ("qk_norm_rope", "float32", "out"): FP32_ROW,
    ("qk_norm_rope", "float32", "grad"): FP32_ROW,
    ("qk_norm_rope", "float32", "grad:weight"): FP32_SUM,
    ("qk_norm_rope", "bfloat16", "out"): BF16_ROW,
    ("qk_norm_rope", "bfloat16", "grad"): BF16_ROW,
    # gated_residual: one fused multiply-add per element; the gate grad is a segmented fp32 sum.
    ("gated_residual", "float32", "out"): FP32_ROW,
    ("gated_residual", "float32", "grad"): FP32_ROW,
    ("gated_residual", "float32", "grad:table"): FP32_SUM,
    ("gated_residual", "bfloat16", "out"): BF16_ROW,
    ("gated_residual", "bfloat16", "grad"): BF16_ROW,
    ("gated_residual", "bfloat16", "grad:table"): Tol(2e-5, 2e-5, "fp32 gate grad, fp32 sums; diffusers "
                                                      "scatter-adds bf16", vs_ref=0.05),
    # residual_add: one addition, one rounding: bit-identical to torch.
    ("residual_add", "float32", "out"): FP32_ROW,
    ("residual_add", "float32", "grad"): Tol(0.0, 0.0, "dy passed through: exact"),
    ("residual_add", "bfloat16", "out"): BF16_ROW,
    ("residual_add", "bfloat16", "grad"): Tol(0.0, 0.0, "dy passed through: exact", vs_ref=1.0),
    # swiglu: elementwise, fp32 silu.
    ("swiglu", "float32", "out"): FP32_ROW,
    ("swiglu", "float32", "grad"): FP32_ROW,
    ("swiglu", "bfloat16", "out"): BF16_ROW,
    ("swiglu", "bfloat16", "grad"): BF16_ROW,
}


def lookup(op: str, dtype: torch.dtype | str, what: str) -> Tol:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    key = (op, name, what)
    if key in TOLERANCES:
        return TOLERANCES[key]
    if what.startswith("grad:") and (op, name, "grad") in TOLERANCES:
        return TOLERANCES[(op, name, "grad")]
    raise KeyError(f"no tolerance for {key}: add one to tests/kernels/tolerances.py with its reason")
