"""Diagnostic probes on the FP32 reference: per-node isolation in any transformer block, attention conditioning.

Isolation (``isolate_block(i)``): the golden replay of ``tasks.golden`` moved to block i. Block i's FP32 inputs
are the FP32 reference's ``fwd/transformer_blocks.{i-1}`` (block 0: the captured ``in/transformer_blocks.0/
hidden_states``) with the shared ``temb``, ``adaln_indices`` and rotary cos/sin of ``in/transformer_blocks.0/*``
(diffusers passes the same ones to every block); its output gradient is ``bwd/transformer_blocks.{i+1}`` (or
``bwd/norm_out``). Each node then runs on those exact inputs: FP32 truth, the BF16 reference op and the candidate
op (or the caller's override of that node), forward and backward, as the golden tests do. Per node: ``isolated``
(the candidate's largest relative L2 over its outputs and input gradients), ``reference_bf16`` (the BF16 reference
op's on the same tensor), ``ratio`` (the largest candidate/reference ratio) and ``creates`` (some tensor over the
golden limit ``GOLDEN_FACTOR * reference + GOLDEN_FLOOR``). Per block: the error the candidate chain *inherits*
(its error on block i's input, ``fwd/transformer_blocks.{i-1}``) and *carries out* (on ``fwd/transformer_blocks.i``),
from the baseline gate run, next to the largest provider error on the same tensors. A node that creates error
has a large isolated ratio; a block that only carries error has small isolated ratios and a large inherited error.

Conditioning (``attention_conditioning``): the FP32 model is replayed forward as its reference node chain
(``bind(nodes=())``, bit-identical to diffusers, under the FP32 provider) with an observer that takes the q, k, v
of every attention node (after QK norm and rotary, [S, NH, D]). Per attention call, in float64, head by head:
``max_logit`` = max q.k/sqrt(D); ``mean_entropy`` = mean over heads and queries of the softmax entropy (nats;
``log_s`` = log S is its maximum); ``sensitivity_{dq,dk,dv}`` = ||dX' - dX|| / ||dX|| where dX are the gradients of
softmax(qk^T/sqrt(D)) v for a seeded N(0, 1) upstream gradient and ' marks inputs with relative noise
``REL_NOISE`` (each element times 1 + 2**-8 N(0, 1), the size of a BF16 rounding); ``amplification_*`` is that over
2**-8. Large logits, low entropy and amplification well above 1 mark an attention that BF16 inputs cannot pin down.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tasks.capture import GOLDEN_ARGS, GOLDEN_BLOCK
from tasks.compare import TensorComparison, parse_float
from tasks.model import CheckpointRef, Preset, load_model, model_inputs, read_sample
from tasks.providers import activate, fp32_provider, resolve_provider
from tasks.reference import ReferenceInfo
from tasks.rules import EnsembleRule
from tasks.store import Store

REL_NOISE = 2.0**-8  # BF16 unit roundoff: the relative size of rounding an FP32 input to BF16


def path_blocks(first_drift: str | None, num_layers: int) -> list[int]:
    """The transformer block the first drift lies in (``fwd/``, ``bwd/`` or ``grad/`` of it); else block 0."""
    found = re.search(r"transformer_blocks\.(\d+)", first_drift or "")
    index = int(found[1]) if found else 0
    return [index] if index < num_layers else [0]


def _error(comparisons: Mapping[str, TensorComparison], rule: EnsembleRule, name: str) -> dict[str, Any]:
    c = comparisons.get(name)
    return {"tensor": name, "relative_l2": None if c is None else c.relative_l2,
            "max_provider_error": rule.max_provider_error.get(name)}


def isolate_block(store: Store, reference: ReferenceInfo, checkpoint: CheckpointRef, fp32_model: torch.nn.Module,
                  index: int, *, device: str, overrides: Mapping[tuple[str, str], Callable[..., Any]],
                  comparisons: Mapping[str, TensorComparison], rule: EnsembleRule) -> dict[str, Any]:
    """Every node of transformer block ``index`` on its exact FP32-reference inputs (module docstring)."""
    from h3kernels.nodes import CANDIDATE_OPS, REFERENCE_OPS
    from tasks import golden

    manifest = store.read_manifest(reference.fp32_run)["tensors"]
    num_layers = len(fp32_model.transformer_blocks)

    def get(name: str) -> torch.Tensor:
        if name not in manifest:
            raise LookupError(f"the FP32 reference run has no {name}: regenerate the reference")
        return store.get_tensor(manifest[name]["sha256"], name=name, device=device)

    inputs = {arg: get(f"in/{GOLDEN_BLOCK}/{arg}") for arg in GOLDEN_ARGS}
    if index > 0:
        inputs["hidden_states"] = get(f"fwd/transformer_blocks.{index - 1}")
    grad = get(f"bwd/transformer_blocks.{index + 1}" if index + 1 < num_layers else "bwd/norm_out")
    for arg in ("hidden_states", "temb"):
        inputs[arg] = inputs[arg].detach().requires_grad_(True)
    name = f"transformer_blocks.{index}"
    bf16_block = load_model(store, checkpoint, torch.bfloat16, device).transformer_blocks[index]
    with activate(fp32_provider(device), device):
        truth = golden._replay(fp32_model.transformer_blocks[index], inputs, grad)
    fp32_model.zero_grad(set_to_none=True)
    bf16_inputs = dict(inputs, hidden_states=inputs["hidden_states"].detach().to(torch.bfloat16))
    nodes = []
    with activate(resolve_provider(reference.default_provider, device), device):
        dtypes = [[a.dtype if isinstance(a, torch.Tensor) else None for a in r["args"]]
                  for r in golden._replay(bf16_block, bf16_inputs, None)]
        for record, dts in zip(truth, dtypes, strict=True):
            node = record["node"]
            op = overrides.get((name, node), CANDIDATE_OPS[node])
            nodes.append(_node_summary(node, golden._node_tests(record, dts, op, REFERENCE_OPS[node])))
    return {"block": name, "index": index, "overridden": sorted(n for b, n in overrides if b == name),
            "inherited": _error(comparisons, rule, f"fwd/transformer_blocks.{index - 1}") if index else None,
            "carried_out": _error(comparisons, rule, f"fwd/{name}"), "nodes": nodes}


def _node_summary(node: str, tests: list[dict[str, Any]]) -> dict[str, Any]:
    worst, ratio = None, 0.0
    for t in tests:
        cand, ref = parse_float(t["candidate_relative_l2"]), parse_float(t["reference_bf16_relative_l2"])
        r = math.inf if not math.isfinite(cand) else (cand / ref if ref > 0 else (0.0 if cand == 0 else math.inf))
        if worst is None or r > ratio:
            worst, ratio = t, r
    return {"node": node, "tensor": worst and f"{worst['direction']}/{worst['tensor']}",
            "isolated": worst and parse_float(worst["candidate_relative_l2"]),
            "reference_bf16": worst and parse_float(worst["reference_bf16_relative_l2"]), "ratio": ratio,
            "creates": any(t["outcome"] == "failed" for t in tests), "checks": len(tests)}


# ------------------------------------------------------------------------------------------------ conditioning


def attention_stats(q_SND: torch.Tensor, k_SND: torch.Tensor, v_SND: torch.Tensor, *, seed: int = 0,
                    rel_noise: float = REL_NOISE) -> dict[str, float]:
    """max logit, mean softmax entropy and dq/dk/dv sensitivity of one attention call (module docstring)."""
    # float64 throughout: the measured changes (~2**-8) must not mix with the probe's own rounding.
    q, k, v = (t.detach().to(torch.float64) for t in (q_SND, k_SND, v_SND))
    S, NH, D = q.shape
    scale = D**-0.5  # diffusers' default SDPA scale (the model passes none)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def noise(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(q.device)

    grad_o = noise((S, NH, D))
    perturbed = [t * (1.0 + rel_noise * noise(tuple(t.shape))) for t in (q, k, v)]
    max_logit, entropy = -math.inf, 0.0
    diff2, norm2 = [0.0] * 3, [0.0] * 3
    for h in range(NH):
        logits = (q[:, h] @ k[:, h].T) * scale
        max_logit = max(max_logit, float(logits.max()))
        logp = torch.log_softmax(logits, dim=-1)
        entropy += float(-(logp.exp() * logp).sum())
        del logits, logp
        base = _attention_grads(q[:, h], k[:, h], v[:, h], grad_o[:, h], scale)
        moved = _attention_grads(*(t[:, h] for t in perturbed), grad_o[:, h], scale)
        for j in range(3):
            diff2[j] += float((moved[j] - base[j]).square().sum())
            norm2[j] += float(base[j].square().sum())
    out: dict[str, float] = {"max_logit": max_logit, "mean_entropy": entropy / (S * NH), "log_s": math.log(S)}
    for j, what in enumerate(("dq", "dk", "dv")):
        rel = math.sqrt(diff2[j] / norm2[j]) if norm2[j] > 0 else 0.0
        out[f"sensitivity_{what}"] = rel
        out[f"amplification_{what}"] = rel / rel_noise
    return out


def _attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_o: torch.Tensor, scale: float,
                     ) -> tuple[torch.Tensor, ...]:
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = torch.softmax((q @ k.T) * scale, dim=-1) @ v
        return torch.autograd.grad(o, (q, k, v), grad_o)


def attention_conditioning(store: Store, reference: ReferenceInfo, preset: Preset, fp32_model: torch.nn.Module,
                           device: str) -> list[dict[str, Any]]:
    """Per attention call of the FP32 reference forward (execution order): block name and attention_stats."""
    from h3kernels import bind
    from h3kernels.nodes import NODE_GROUPS

    sample = read_sample(store, reference.sample_sha, preset.config)
    rows: list[dict[str, Any]] = []

    def observer(block: str, node: str, args: tuple, out: Any) -> None:
        if node in NODE_GROUPS["attention"]:
            rows.append({"block": block, "node": node, **attention_stats(*args[:3], seed=len(rows))})

    with torch.no_grad(), activate(fp32_provider(device), device), bind(fp32_model, nodes=(), observer=observer):
        fp32_model(**model_inputs(sample, device), return_dict=True)
    return rows
