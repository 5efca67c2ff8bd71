"""Pure-torch references of every h3kernels op, with diffusers' arithmetic in the input dtype.

Each function takes the same arguments as the candidate op of the same name and computes what diffusers
computes for it (`transformer_minimax_h3.py` and `activations.SwiGLU`), op by op, rounding where diffusers
rounds. On float64 inputs the same functions are the float64 ground truth. Golden tests check them against
the diffusers modules themselves; the candidate tests, the benchmarks and the diagnostics all import these.

Legend: S rows, H hidden, T timesteps, E time_embed_dim, C projection width, W table row width, R table rows,
NH heads, D head dim, RD rotary dim, F ffn dim.

Where diffusers' dtypes follow from the module, the reference follows the activation: the AdaLN table is cast to
the activation dtype (diffusers' table is in the adaln_proj dtype, which is the block dtype) and cos/sin too
(diffusers' `_apply_rotary_emb` casts them to the hidden-states dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MODALITY_NUM = 3  # diffusers MINIMAX_H3_MODALITY_NUM


def adaln_table(temb_TE: torch.Tensor, weight_CE: torch.Tensor, bias_C: torch.Tensor,
                row_width: int | None = None) -> torch.Tensor:
    """MiniMaxH3AdaLayerNormModulation / AdaLayerNormOut projection: silu at temb's precision, then the
    projection in the weight dtype (the table comes out in the weight dtype, bf16 in the checkpoint)."""
    width = weight_CE.shape[0] // MODALITY_NUM if row_width is None else row_width
    return F.linear(F.silu(temb_TE).to(weight_CE.dtype), weight_CE, bias_C).view(-1, width)


def segment_sum(values_SH: torch.Tensor, idx_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    """What autograd does for `table.index_select(0, idx)` backward: a scatter-add in values' dtype."""
    out = torch.zeros((num_rows, values_SH.shape[1]), dtype=values_SH.dtype, device=values_SH.device)
    return out.index_add(0, idx_S, values_SH)


def _chunk(table: torch.Tensor, H: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    # diffusers' `.chunk(6, -1)` of a [R, 6H] table is the H-wide split; the cast models its bf16 table.
    return table.to(dtype).split(H, dim=-1)[chunk]


def rms_norm(x_SH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.RMSNorm (refiner norm1/norm2, token_refiner.final_norm, norm_out.norm)."""
    return F.rms_norm(x_SH, (x_SH.shape[-1],), weight_H, eps)


def rms_norm_modulate(x_SH: torch.Tensor, weight_H: torch.Tensor, table_RKH: torch.Tensor, idx_S: torch.Tensor,
                      shift_chunk: int, scale_chunk: int, eps: float) -> torch.Tensor:
    """Block norm1/norm2 + modulate (and norm_out with its 2-chunk table): norm, then `* (1 + scale) + shift`."""
    H = x_SH.shape[-1]
    scale = _chunk(table_RKH, H, scale_chunk, x_SH.dtype).index_select(0, idx_S)
    shift = _chunk(table_RKH, H, shift_chunk, x_SH.dtype).index_select(0, idx_S)
    return rms_norm(x_SH, weight_H, eps) * (1.0 + scale) + shift


def gated_residual(x_SH: torch.Tensor, branch_SH: torch.Tensor, table_RKH: torch.Tensor, idx_S: torch.Tensor,
                   gate_chunk: int) -> torch.Tensor:
    """`residual + gate.index_select(0, idx) * branch` of the block."""
    gate = _chunk(table_RKH, x_SH.shape[-1], gate_chunk, x_SH.dtype).index_select(0, idx_S)
    return x_SH + gate * branch_SH


def residual_add(x_SH: torch.Tensor, branch_SH: torch.Tensor) -> torch.Tensor:
    """Refiner blocks: `hidden_states + branch`."""
    return x_SH + branch_SH


def apply_rotary_emb(x_SND: torch.Tensor, cos_SRD: torch.Tensor, sin_SRD: torch.Tensor) -> torch.Tensor:
    """diffusers `_apply_rotary_emb` for a [S, NH, D] tensor (cos/sin cast to x's dtype first, as there)."""
    rd = cos_SRD.shape[-1]
    rot, rest = x_SND[..., :rd], x_SND[..., rd:]
    cos = cos_SRD.to(x_SND.dtype)[:, None, :]
    sin = sin_SRD.to(x_SND.dtype)[:, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, rest), dim=-1).contiguous()


def qk_norm_rope(x_SND: torch.Tensor, weight_D: torch.Tensor, cos_SRD: torch.Tensor | None,
                 sin_SRD: torch.Tensor | None, eps: float) -> torch.Tensor:
    """attn.norm_q / norm_k (RMSNorm over D) then `_apply_rotary_emb` when a rotary embedding is given."""
    y = F.rms_norm(x_SND, (x_SND.shape[-1],), weight_D, eps)
    return y if cos_SRD is None else apply_rotary_emb(y, cos_SRD, sin_SRD)


def swiglu(proj_SF2: torch.Tensor) -> torch.Tensor:
    """diffusers SwiGLU after its projection: `h * silu(g)`, h the first half, g the second."""
    h, g = proj_SF2.chunk(2, dim=-1)
    return h * F.silu(g)


__all__ = ["adaln_table", "apply_rotary_emb", "gated_residual", "qk_norm_rope", "residual_add", "rms_norm",
           "rms_norm_modulate", "segment_sum", "swiglu"]
