"""Block-0 golden tests: every candidate node, in isolation, on the exact inputs it saw in the FP32 reference.

How the inputs are recovered: the FP32 reference run captured block 0's inputs
(``in/transformer_blocks.0/{hidden_states,temb,adaln_indices,rotary_cos,rotary_sin}``) and the
gradient of its output (``bwd`` of the next module). Block 0 of the FP32 model is replayed as its node
chain with the reference ops (bit-identical to diffusers, ``h3kernels.binding``) and an observer that
keeps each node's inputs, output and (after backward) output gradient. Then, per node:

- FP32 truth: the reference op on the FP32 inputs, forward and backward (input and weight gradients);
- the reference op in BF16 on the same inputs rounded the way the BF16 model feeds them (the dtypes
  are read off a BF16 replay, so ``temb`` and ``cos/sin`` stay FP32 as in the mixed-precision model);
- the candidate op in BF16 on those same inputs.

Test: candidate error <= GOLDEN_FACTOR * BF16-reference error + GOLDEN_FLOOR, per output and per
gradient; NaN/Inf fails. Results are ``tests.json`` records (name, node, direction, tensor, outcome,
errors, limit), one per (node, tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tasks.capture import GOLDEN_ARGS, GOLDEN_BLOCK
from tasks.compare import compare_tensors
from tasks.model import CheckpointRef, Preset, load_model
from tasks.providers import activate, fp32_provider, resolve_provider
from tasks.reference import ReferenceInfo
from tasks.store import Store

# Isolated-node tolerance: fused candidate ops round once from FP32, so they are at or below the BF16
# reference op's error; attention rounds P and dS to BF16 as flash attention does (1.2-1.6x the math
# backend's error measured on random inputs). 2x the reference's own error still catches any real bug,
# whose error is orders of magnitude above BF16 rounding.
GOLDEN_FACTOR = 2.0
# Absolute allowance for tensors whose BF16 reference error is ~0 (e.g. exact integer-like outputs).
GOLDEN_FLOOR = 1e-6


def _upstream_name(manifest_tensors: Mapping[str, Any], num_layers: int) -> str:
    """The captured gradient of block 0's output: the next module's input gradient."""
    name = "bwd/transformer_blocks.1" if num_layers > 1 else "bwd/norm_out"
    if name not in manifest_tensors:
        raise LookupError(f"the FP32 reference has no {name}: it cannot seed the golden backward")
    return name


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _replay(block: torch.nn.Module, inputs: Mapping[str, torch.Tensor], grad: torch.Tensor | None) -> list[dict]:
    """Run ``block`` as its reference node chain, recording each node's args, outputs and output grads."""
    from h3kernels import bind

    records: list[dict] = []

    def observer(block_name: str, node: str, args: tuple, out: Any) -> None:
        outputs = _flat(out)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.retain_grad()
        records.append({"node": node, "args": args, "outputs": outputs})

    with bind(block_wrapper(block), nodes=(), observer=observer):
        out = block(inputs["hidden_states"], inputs["temb"], inputs["adaln_indices"],
                    (inputs["rotary_cos"], inputs["rotary_sin"]))
    if grad is not None:
        out.backward(grad.to(out.dtype).reshape(out.shape))
    return records


def block_wrapper(block: torch.nn.Module) -> torch.nn.Module:
    """A minimal container so the binding finds a transformer block by its model name."""
    container = torch.nn.Module()
    container.transformer_blocks = torch.nn.ModuleList([block])
    return container


def _leaf(t: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if not t.is_floating_point():
        return t.detach()
    out = t.detach().to(dtype or t.dtype).contiguous()
    return out.requires_grad_(t.requires_grad)


def _run_op(op: Any, args: tuple, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], list[Any]]:
    """Forward and backward of one op; returns (outputs, gradients of its differentiable args)."""
    outputs = _flat(op(*args))
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    return [o.detach() for o in outputs], [a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None
                                           for a in args]


def run_golden(store: Store, reference: ReferenceInfo, preset: Preset, checkpoint: CheckpointRef, *,
               device: str) -> dict[str, Any]:
    """Run the block-0 golden tests; returns the tests.json document (``passed`` and one record per check)."""
    from h3kernels.nodes import CANDIDATE_OPS, REFERENCE_OPS

    manifest = store.read_manifest(reference.fp32_run)["tensors"]
    names = {arg: f"in/{GOLDEN_BLOCK}/{arg}" for arg in GOLDEN_ARGS}
    missing = [n for n in names.values() if n not in manifest]
    if missing:
        raise LookupError(f"the FP32 reference run lacks the golden inputs {missing}: regenerate the reference")
    inputs = {arg: store.get_tensor(manifest[n]["sha256"], name=n, device=device) for arg, n in names.items()}
    upstream = _upstream_name(manifest, int(preset.config["num_layers"]))
    grad = store.get_tensor(manifest[upstream]["sha256"], name=upstream, device=device)

    fp32_block = load_model(store, checkpoint, torch.float32, device).transformer_blocks[0]
    bf16_block = load_model(store, checkpoint, torch.bfloat16, device).transformer_blocks[0]
    for arg in ("hidden_states", "temb"):
        inputs[arg] = inputs[arg].detach().requires_grad_(True)
    with activate(fp32_provider(device), device):
        truth = _replay(fp32_block, inputs, grad)
    bf16_inputs = dict(inputs, hidden_states=inputs["hidden_states"].detach().to(torch.bfloat16))
    with activate(resolve_provider(reference.default_provider, device), device):
        bf16_dtypes = [[a.dtype if isinstance(a, torch.Tensor) else None for a in r["args"]]
                       for r in _replay(bf16_block, bf16_inputs, None)]
        tests = []
        for record, dtypes in zip(truth, bf16_dtypes, strict=True):
            tests += _node_tests(record, dtypes, CANDIDATE_OPS[record["node"]], REFERENCE_OPS[record["node"]])
    return {
        "suite": "golden",
        "block": GOLDEN_BLOCK,
        "factor": GOLDEN_FACTOR,
        "floor": GOLDEN_FLOOR,
        "passed": all(t["outcome"] == "passed" for t in tests),
        "tests": tests,
    }


def _node_tests(record: Mapping[str, Any], dtypes: list[torch.dtype | None], candidate: Any,
                reference_op: Any) -> list[dict[str, Any]]:
    node = record["node"]
    grads = [o.grad if isinstance(o, torch.Tensor) else None for o in record["outputs"]]
    fp32_args = tuple(_leaf(a, None) for a in record["args"])
    truth_out, truth_grads = _run_op(reference_op, fp32_args, grads)
    results = {}
    for label, op in (("candidate", candidate), ("reference_bf16", reference_op)):
        args = tuple(_leaf(a, d) for a, d in zip(record["args"], dtypes, strict=True))
        results[label] = _run_op(op, args, grads)
    tests = []
    for index, truth in enumerate(truth_out):
        tests.append(_check(node, "forward", f"out{index}", truth,
                            results["candidate"][0][index], results["reference_bf16"][0][index]))
    for index, truth in enumerate(truth_grads):
        cand, ref16 = results["candidate"][1][index], results["reference_bf16"][1][index]
        if truth is None or cand is None or ref16 is None:
            continue
        tests.append(_check(node, "backward", f"grad_arg{index}", truth, cand, ref16))
    return tests


def _check(node: str, direction: str, tensor: str, truth: torch.Tensor, candidate: torch.Tensor,
           reference_bf16: torch.Tensor) -> dict[str, Any]:
    name = f"golden/{GOLDEN_BLOCK}/{node}/{direction}/{tensor}"
    cand = compare_tensors(name, candidate, truth)
    ref = compare_tensors(name, reference_bf16, truth)
    limit = GOLDEN_FACTOR * ref.relative_l2 + GOLDEN_FLOOR
    passed = cand.nonfinite == 0 and cand.relative_l2 <= limit
    return {
        "name": name,
        "node": node,
        "direction": direction,
        "tensor": tensor,
        "outcome": "passed" if passed else "failed",
        "candidate_relative_l2": cand.relative_l2 if cand.relative_l2 != float("inf") else "inf",
        "reference_bf16_relative_l2": ref.relative_l2 if ref.relative_l2 != float("inf") else "inf",
        "candidate_max_abs": cand.max_abs if cand.max_abs != float("inf") else "inf",
        "limit": limit if limit != float("inf") else "inf",
        "skip_reason": None,
    }
