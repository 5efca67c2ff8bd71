"""The nodes of the MiniMax-H3 blocks: names, groups, and one candidate op and one reference op per node.

A node is one step of a block's forward (DESIGN 7). `CANDIDATE_OPS[node]` and `REFERENCE_OPS[node]` take the
same arguments and return the same structure; the binding (`binding.py`) runs a block as a chain of node calls
and picks one of the two per node. `CANDIDATE_CHECKS[node](*args)` says why the candidate cannot run on these
arguments (a string) or None; the binding turns a reason into a strict-mode `NodeFallback`.

Legend: S rows (packed sequence, or text rows in the refiner), H hidden, T timesteps, E time_embed_dim, R table
rows, NH heads, D head dim, RD rotary dim, F ffn dim. Activations are 2-D [S, H] (batch 1); heads are [S, NH, D].

Node signatures (the same for both tables):
    adaln_proj(temb_TE, weight_CE, bias_C) -> table [3T, 6H]
    norm1_modulate / norm2_modulate(x_SH, weight_H, table, idx_S, shift_chunk, scale_chunk, eps) -> [S, H]
    qkv / refiner_qkv(x_SH, wq, wk, wv) -> (q, k, v), each [S, NH*D]
    qk_norm_rope / refiner_qk_norm(q_SND, k_SND, wq_D, wk_D, cos_SRD|None, sin_SRD|None, eps_q, eps_k) -> (q, k)
    attention / refiner_attention(q_SND, k_SND, v_SND, backend, parallel_config) -> o_SND
    to_out, ff_in, ff_out and refiner twins (x, weight, bias|None) -> x @ weight^T (+ bias)
    gate_residual_attn / gate_residual_ff(x_SH, branch_SH, table, idx_S, gate_chunk) -> [S, H]
    swiglu / refiner_swiglu(proj_SF2) -> [S, F]
    refiner_norm1 / refiner_norm2 / refiner_final_norm(x_SH, weight_H, eps) -> [S, H]
    refiner_residual_attn / refiner_residual_ff(x_SH, branch_SH) -> [S, H]
    norm_out(x_SH, temb_TE, weight_CE, bias_C, norm_weight_H, idx_S, eps) -> [S, H]

Precision: the candidate's AdaLN tables are float32 end to end (`modulation.adaln_table`) and go to the norm and
residual kernels as they are, which read their rows by index (no gathered [S, H] shift/scale/gate tensors). The
reference's table is diffusers' `adaln_proj(temb)`, in the projection's (bf16) dtype, gathered per row in the
activation dtype. GEMMs are `F.linear` in the activation dtype in both tables (cuBLAS on the GPU): the candidate
keeps them as named nodes so the ledger shows they ran, not because they compute differently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from h3kernels import reference
from h3kernels._common import ACTIVATION_DTYPES, check_inputs, is_interpreting
from h3kernels.attention import CONFIGS as ATTENTION_CONFIGS
from h3kernels.attention import attention as attention_kernel
from h3kernels.modulation import adaln_table
from h3kernels.norm import rms_norm, rms_norm_modulate
from h3kernels.qk_norm_rope import qk_norm_rope
from h3kernels.residual import gated_residual, residual_add
from h3kernels.swiglu import swiglu

BLOCK_NODES: tuple[str, ...] = (
    "adaln_proj", "norm1_modulate", "qkv", "qk_norm_rope", "attention", "to_out", "gate_residual_attn",
    "norm2_modulate", "ff_in", "swiglu", "ff_out", "gate_residual_ff",
)
REFINER_NODES: tuple[str, ...] = (
    "refiner_norm1", "refiner_qkv", "refiner_qk_norm", "refiner_attention", "refiner_to_out",
    "refiner_residual_attn", "refiner_norm2", "refiner_ff_in", "refiner_swiglu", "refiner_ff_out",
    "refiner_residual_ff",
)
BOUNDARY_NODES: tuple[str, ...] = ("refiner_final_norm", "norm_out")
ALL_NODES: tuple[str, ...] = BLOCK_NODES + REFINER_NODES + BOUNDARY_NODES

NODE_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("attention", "refiner_attention"),
    "gemms": ("qkv", "to_out", "ff_in", "ff_out", "refiner_qkv", "refiner_to_out", "refiner_ff_in",
              "refiner_ff_out"),
    "swiglu": ("swiglu", "refiner_swiglu"),
    "qk_norm_rope": ("qk_norm_rope", "refiner_qk_norm"),
    "norms_modulate": ("norm1_modulate", "norm2_modulate", "refiner_norm1", "refiner_norm2", "norm_out",
                       "refiner_final_norm"),
    "residuals": ("gate_residual_attn", "gate_residual_ff", "refiner_residual_attn", "refiner_residual_ff"),
    "adaln_proj": ("adaln_proj",),
}

# Column chunks of a block's AdaLN table row (diffusers' `.chunk(6, -1)` order) and of norm_out's (shift, scale).
SHIFT_MSA, SCALE_MSA, GATE_MSA, SHIFT_MLP, SCALE_MLP, GATE_MLP = range(6)
NORM_OUT_SHIFT, NORM_OUT_SCALE = 0, 1

Op = Callable[..., object]


# ------------------------------------------------------------------------------------------------ candidate


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    named = [("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    check_inputs("linear", *named)
    # In the activation dtype through cuBLAS (fp32 accumulation inside the GEMM): the same call diffusers makes.
    return F.linear(x, weight, bias)


def _qkv(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _linear(x, wq, None), _linear(x, wk, None), _linear(x, wv, None)


def _qk(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor | None,
        sin: torch.Tensor | None, eps_q: float, eps_k: float) -> tuple[torch.Tensor, torch.Tensor]:
    # cos/sin stay fp32 (the rope buffer's dtype); diffusers rounds them to the activation dtype first.
    return qk_norm_rope(q, wq, cos, sin, eps_q), qk_norm_rope(k, wk, cos, sin, eps_k)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object, parallel_config: object,
               ) -> torch.Tensor:
    # backend / parallel_config: the reference's dispatcher arguments; the candidate is its own backend.
    return attention_kernel(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))[0]


def _norm_out(x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              norm_weight: torch.Tensor, idx: torch.Tensor, eps: float) -> torch.Tensor:
    # The [T, 2H] (shift, scale) table stays fp32 and is read by index inside the norm kernel.
    table = adaln_table(temb, weight, bias, row_width=weight.shape[0])
    return rms_norm_modulate(x, norm_weight, table, idx, NORM_OUT_SHIFT, NORM_OUT_SCALE, eps)


CANDIDATE_OPS: dict[str, Op] = {
    "adaln_proj": adaln_table,
    "norm1_modulate": rms_norm_modulate,
    "qkv": _qkv,
    "qk_norm_rope": _qk,
    "attention": _attention,
    "to_out": _linear,
    "gate_residual_attn": gated_residual,
    "norm2_modulate": rms_norm_modulate,
    "ff_in": _linear,
    "swiglu": swiglu,
    "ff_out": _linear,
    "gate_residual_ff": gated_residual,
    "refiner_norm1": rms_norm,
    "refiner_qkv": _qkv,
    "refiner_qk_norm": _qk,
    "refiner_attention": _attention,
    "refiner_to_out": _linear,
    "refiner_residual_attn": residual_add,
    "refiner_norm2": rms_norm,
    "refiner_ff_in": _linear,
    "refiner_swiglu": swiglu,
    "refiner_ff_out": _linear,
    "refiner_residual_ff": residual_add,
    "refiner_final_norm": rms_norm,
    "norm_out": _norm_out,
}


# ------------------------------------------------------------------------------------------------ reference


def _ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _ref_qkv(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)


def _ref_qk(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor | None,
            sin: torch.Tensor | None, eps_q: float, eps_k: float) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.qk_norm_rope(q, wq, cos, sin, eps_q), reference.qk_norm_rope(k, wk, cos, sin, eps_k)


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object, parallel_config: object,
                   ) -> torch.Tensor:
    # diffusers' own dispatcher with the block processor's backend: the reference is whatever provider is active.
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    o = dispatch_attention_fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=None, dropout_p=0.0,
                              is_causal=False, backend=backend, parallel_config=parallel_config)
    return o[0]


def _ref_norm_out(x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  norm_weight: torch.Tensor, idx: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers' [T, 2H] table in the projection dtype, gathered per row (MiniMaxH3AdaLayerNormOut.forward).
    table = reference.adaln_table(temb, weight, bias, row_width=weight.shape[0])
    return reference.rms_norm_modulate(x, norm_weight, table, idx, NORM_OUT_SHIFT, NORM_OUT_SCALE, eps)


REFERENCE_OPS: dict[str, Op] = {
    "adaln_proj": reference.adaln_table,
    "norm1_modulate": reference.rms_norm_modulate,
    "qkv": _ref_qkv,
    "qk_norm_rope": _ref_qk,
    "attention": _ref_attention,
    "to_out": _ref_linear,
    "gate_residual_attn": reference.gated_residual,
    "norm2_modulate": reference.rms_norm_modulate,
    "ff_in": _ref_linear,
    "swiglu": reference.swiglu,
    "ff_out": _ref_linear,
    "gate_residual_ff": reference.gated_residual,
    "refiner_norm1": reference.rms_norm,
    "refiner_qkv": _ref_qkv,
    "refiner_qk_norm": _ref_qk,
    "refiner_attention": _ref_attention,
    "refiner_to_out": _ref_linear,
    "refiner_residual_attn": reference.residual_add,
    "refiner_norm2": reference.rms_norm,
    "refiner_ff_in": _ref_linear,
    "refiner_swiglu": reference.swiglu,
    "refiner_ff_out": _ref_linear,
    "refiner_residual_ff": reference.residual_add,
    "refiner_final_norm": reference.rms_norm,
    "norm_out": _ref_norm_out,
}


# ------------------------------------------------------------------------------------------------ checks


def _tensors(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def check_runnable(*args: object) -> str | None:
    """Why the Triton candidate cannot run on these arguments (dtype, device), or None.

    Only what a different machine or model dtype would change: malformed inputs (empty, non-contiguous, mixed
    devices, bad indices) are left to the kernels, which raise KernelInputError for them.
    """
    tensors = _tensors(args)
    if len({t.device for t in tensors}) > 1:
        return None  # mixed devices are a malformed call, not a capability gap: the kernel names them
    for t in tensors:
        if t.is_floating_point() and t.dtype not in ACTIVATION_DTYPES:
            return f"dtype {t.dtype} is not supported (float32 or bfloat16)"
        if t.device.type == "cpu" and not is_interpreting():
            return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); the candidate runs on CUDA"
        if t.device.type not in ("cpu", "cuda"):
            return f"device {t.device} is not supported (cuda, or cpu under TRITON_INTERPRET=1)"
    return None


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object, parallel_config: object,
                     ) -> str | None:
    head_dims = sorted({d for d, _ in ATTENTION_CONFIGS})
    if isinstance(q, torch.Tensor) and q.ndim == 3 and q.shape[-1] not in head_dims:
        return f"head dim {q.shape[-1]} is not supported (one of {head_dims})"
    if parallel_config is not None:
        return "context parallelism is not supported (the candidate attends over one unsharded sequence)"
    return check_runnable(q, k, v)


CANDIDATE_CHECKS: dict[str, Callable[..., str | None]] = {
    node: (_check_attention if node in NODE_GROUPS["attention"] else check_runnable) for node in ALL_NODES
}

__all__ = ["ALL_NODES", "BLOCK_NODES", "BOUNDARY_NODES", "CANDIDATE_CHECKS", "CANDIDATE_OPS", "NODE_GROUPS",
           "REFERENCE_OPS", "REFINER_NODES", "check_runnable"]
