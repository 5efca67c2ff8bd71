"""Bind the candidate kernels into a diffusers MiniMax-H3 model, node by node, and count what ran.

bind(model, nodes=ALL_NODES, *, strict=True, blocks=None, overrides=None, observer=None) -> Binding
    Every MiniMaxH3TransformerBlock, MiniMaxH3TokenRefinerBlock, the AdaLN `norm_out` and the refiner's
    `final_norm` of `model` (or those named in `blocks`, e.g. {"transformer_blocks.1"}) get an instance
    `forward` that runs the module's forward as an explicit chain of node calls `op(*args)` (nodes.py) on the
    module's own parameters: no copies, `state_dict()` unchanged, and module hooks still fire because
    `Module.__call__` is untouched. A node in `nodes` uses its candidate op (Triton; GEMMs are `F.linear`), any
    other node its reference op (diffusers' arithmetic: with `nodes=()` a bound model is bit-identical to
    diffusers). `overrides[(block_name, node)] = op` replaces the op of one bound node in one block (mutants,
    diagnostics); it runs unchecked and counts as that node. `observer(block_name, node, args, output)` is
    called after every node of every bound module, in execution order.
Strict mode
    Before a candidate op runs, `nodes.CANDIDATE_CHECKS` says whether it can (dtype float32/bfloat16, CUDA or
    CPU under TRITON_INTERPRET=1, attention head dim, no context parallelism). strict=True raises
    `NodeFallback(RuntimeError)` naming block, node and reason; strict=False runs the reference op and records
    the first reason as the node's `fallback`. Malformed inputs (empty, non-contiguous, mixed devices, bad index
    dtype or range) raise the kernels' KernelInputError, prefixed with "block/node: ", in both modes.
Binding
    blocks: the names of the modules that run the chain (bound or not, each node), in module order.
    ledger: {block_name: {node: {"forward": n, "backward": m, "fallback": reason | None}}} for bound nodes;
        forward counts candidate (or override) executions, backward counts the times autograd computed the
        gradient of that execution's output (a tensor hook on its first differentiable output).
    missing() -> ["block/node", ...] bound nodes with forward == 0 or backward == 0 (the gate fails on any).
    describe() -> {"nodes", "blocks", "strict", "overrides", "torch", "triton", "h3kernels_sha256",
        "h3kernels_files"}: the candidate's identity for run manifests (sha256 over the h3kernels sources).
    unbind() (also `unbind(model)`, or leaving `with bind(model) as b:`) deletes the instance forwards: the
    model is exactly as before (no attributes, no hooks, the same parameter objects, identical outputs).
Rejected at bind (ValueError): an already bound model, unknown nodes/blocks/overrides, modules with an instance
forward of their own (e.g. accelerate hooks), custom attention processors, fused QKV projections, non-zero
dropout. Bound modules take batch 1 and no attention mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import triton

from h3kernels._common import KernelInputError
from h3kernels.nodes import (
    ALL_NODES,
    BLOCK_NODES,
    CANDIDATE_CHECKS,
    CANDIDATE_OPS,
    GATE_MLP,
    GATE_MSA,
    REFERENCE_OPS,
    REFINER_NODES,
    SCALE_MLP,
    SCALE_MSA,
    SHIFT_MLP,
    SHIFT_MSA,
)

Observer = Callable[[str, str, tuple, Any], None]
Call = Callable[..., Any]

# Node names of the attention and feed-forward branches, shared by both block kinds.
_BRANCH = {
    "block": ("qkv", "qk_norm_rope", "attention", "to_out", "ff_in", "swiglu", "ff_out"),
    "refiner": ("refiner_qkv", "refiner_qk_norm", "refiner_attention", "refiner_to_out", "refiner_ff_in",
                "refiner_swiglu", "refiner_ff_out"),
}


class NodeFallback(RuntimeError):
    """Strict mode: a bound node's candidate cannot run here; the message names block, node and reason."""


# ------------------------------------------------------------------------------------------------ chains


def _rows(hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.ndim == 3 and hidden_states.shape[0] != 1:
        raise ValueError(f"bound blocks take batch 1 ([1, S, H]), got shape {list(hidden_states.shape)}")
    return hidden_states[0] if hidden_states.ndim == 3 else hidden_states


def _like(x_SH: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    return x_SH.unsqueeze(0) if hidden_states.ndim == 3 else x_SH


def _attn_branch(call: Call, kind: str, attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None) -> torch.Tensor:
    n_qkv, n_qk, n_attn, n_out = _BRANCH[kind][:4]
    q, k, v = call(n_qkv, h, attn.to_q.weight, attn.to_k.weight, attn.to_v.weight)
    q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
    q, k = call(n_qk, q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps, attn.norm_k.eps)
    o = call(n_attn, q, k, v, attn.processor._attention_backend, attn.processor._parallel_config)
    out = attn.to_out[0]  # to_out[1] is Dropout(0.0), checked at bind: the identity
    return call(n_out, o.flatten(1, 2), out.weight, out.bias)


def _ff_branch(call: Call, kind: str, ff: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    n_in, n_act, n_out = _BRANCH[kind][4:]
    proj, out = ff.net[0].proj, ff.net[2]  # net[1] is Dropout(0.0)
    return call(n_out, call(n_act, call(n_in, h, proj.weight, proj.bias)), out.weight, out.bias)


def _block_chain(block: torch.nn.Module, call: Call, hidden_states: torch.Tensor, temb: torch.Tensor,
                 adaln_indices: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """MiniMaxH3TransformerBlock.forward as a chain of the 12 block nodes."""
    if attention_mask is not None:
        raise ValueError("bound blocks run unmasked (MiniMax-H3 passes no attention mask)")
    cos, sin = rotary_emb if rotary_emb is not None else (None, None)
    n1, n2, lin = block.norm1, block.norm2, block.adaln_proj.linear
    x = _rows(hidden_states)
    # Candidate: a float32 table, passed as is to the norm and residual kernels; reference: diffusers' bf16 one.
    table = call("adaln_proj", temb, lin.weight, lin.bias)
    h = call("norm1_modulate", x, n1.weight, table, adaln_indices, SHIFT_MSA, SCALE_MSA, n1.eps)
    x = call("gate_residual_attn", x, _attn_branch(call, "block", block.attn, h, cos, sin), table, adaln_indices,
             GATE_MSA)
    h = call("norm2_modulate", x, n2.weight, table, adaln_indices, SHIFT_MLP, SCALE_MLP, n2.eps)
    x = call("gate_residual_ff", x, _ff_branch(call, "block", block.ff, h), table, adaln_indices, GATE_MLP)
    return _like(x, hidden_states)


def _refiner_chain(block: torch.nn.Module, call: Call, hidden_states: torch.Tensor) -> torch.Tensor:
    """MiniMaxH3TokenRefinerBlock.forward as a chain of the 11 refiner nodes (no AdaLN, no rotary)."""
    x = _rows(hidden_states)
    h = call("refiner_norm1", x, block.norm1.weight, block.norm1.eps)
    x = call("refiner_residual_attn", x, _attn_branch(call, "refiner", block.attn, h, None, None))
    h = call("refiner_norm2", x, block.norm2.weight, block.norm2.eps)
    x = call("refiner_residual_ff", x, _ff_branch(call, "refiner", block.ff, h))
    return _like(x, hidden_states)


def _norm_out_chain(module: torch.nn.Module, call: Call, hidden_states: torch.Tensor, temb: torch.Tensor,
                    timestep_indices: torch.Tensor) -> torch.Tensor:
    """MiniMaxH3AdaLayerNormOut.forward: one node (its table by timestep, RMSNorm, modulate)."""
    lin, norm = module.linear, module.norm
    out = call("norm_out", _rows(hidden_states), temb, lin.weight, lin.bias, norm.weight, timestep_indices, norm.eps)
    return _like(out, hidden_states)


def _final_norm_chain(module: torch.nn.Module, call: Call, hidden_states: torch.Tensor) -> torch.Tensor:
    """token_refiner.final_norm (nn.RMSNorm)."""
    return _like(call("refiner_final_norm", _rows(hidden_states), module.weight, module.eps), hidden_states)


# ------------------------------------------------------------------------------------------------ binding


class _BoundForward:
    """The instance `forward` of a bound module: runs its chain through the binding's node dispatcher."""

    def __init__(self, binding: Binding, name: str, module: torch.nn.Module, chain: Callable[..., torch.Tensor]):
        self.binding, self.name, self.module, self.chain = binding, name, module, chain

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.chain(self.module, self._call, *args, **kwargs)

    def _call(self, node: str, *args: Any) -> Any:
        return self.binding._run(self.name, node, args)


def _kinds(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, tuple[str, ...], Callable]]:
    """Every bindable module of `model`: name -> (module, its node names, its chain), in module order."""
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3AdaLayerNormOut,
        MiniMaxH3TokenRefiner,
        MiniMaxH3TokenRefinerBlock,
        MiniMaxH3TransformerBlock,
    )

    found: dict[str, tuple[torch.nn.Module, tuple[str, ...], Callable]] = {}
    final_norms: set[int] = set()  # the refiners' final_norm modules, named where named_modules reaches them
    for name, module in model.named_modules():
        if id(module) in final_norms:
            found[name] = (module, ("refiner_final_norm",), _final_norm_chain)
        elif isinstance(module, MiniMaxH3TransformerBlock):
            found[name] = (module, BLOCK_NODES, _block_chain)
        elif isinstance(module, MiniMaxH3TokenRefinerBlock):
            found[name] = (module, REFINER_NODES, _refiner_chain)
        elif isinstance(module, MiniMaxH3AdaLayerNormOut):
            found[name] = (module, ("norm_out",), _norm_out_chain)
        elif isinstance(module, MiniMaxH3TokenRefiner):
            final_norms.add(id(module.final_norm))
    return found


def _check_module(name: str, module: torch.nn.Module) -> None:
    from diffusers.models.activations import SwiGLU
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    if isinstance(module.__dict__.get("forward"), _BoundForward):
        raise ValueError(f"{name} is already bound; unbind the model first")
    if "forward" in module.__dict__:
        raise ValueError(f"{name} has an instance forward of its own (an accelerate hook?); bind needs the class one")
    problems = []
    if hasattr(module, "attn"):
        attn, ff = module.attn, module.ff
        if type(attn.processor) is not MiniMaxH3AttnProcessor:
            problems.append(f"attention processor {type(attn.processor).__name__} is not MiniMaxH3AttnProcessor")
        if getattr(attn, "fused_projections", False):
            problems.append("fused QKV projections are not supported (unfuse them first)")
        if not isinstance(ff.net[0], SwiGLU) or len(ff.net) != 3:
            problems.append("the feed-forward is not diffusers' SwiGLU FeedForward")
        problems += [f"{what} has dropout p={d.p}" for what, d in (("attn.to_out", attn.to_out[1]), ("ff", ff.net[1]))
                     if d.p != 0.0]
    eps_of = [m.eps for m in module.modules() if isinstance(m, torch.nn.RMSNorm)]
    if any(e is None for e in eps_of):
        problems.append("an RMSNorm has eps=None (the kernels need the value diffusers passes)")
    if problems:
        raise ValueError(f"cannot bind {name}: " + "; ".join(problems))


def _sources_sha256() -> tuple[str, dict[str, str]]:
    files = sorted(Path(__file__).parent.glob("*.py"))
    per_file = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    total = hashlib.sha256("".join(f"{name}\0{sha}\n" for name, sha in per_file.items()).encode()).hexdigest()
    return total, per_file


class Binding:
    """The candidate bound into one model: the ledger, its checks and the way back (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, nodes: Collection[str] = ALL_NODES, *, strict: bool = True,
                 blocks: Collection[str] | None = None, overrides: Mapping[tuple[str, str], Callable] | None = None,
                 observer: Observer | None = None):
        unknown = sorted(set(nodes) - set(ALL_NODES))
        if unknown:
            raise ValueError(f"unknown nodes {unknown}; known: {list(ALL_NODES)}")
        found = _kinds(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no MiniMax-H3 blocks to bind")
        if blocks is not None and set(blocks) - set(found):
            raise ValueError(f"unknown blocks {sorted(set(blocks) - set(found))}; known: {list(found)}")
        chosen = {n: v for n, v in found.items() if blocks is None or n in blocks}
        self.model, self.strict, self.observer = model, strict, observer
        self._entries = {(name, node): {"forward": 0, "backward": 0, "fallback": None}
                         for name, (_, kind_nodes, _) in chosen.items() for node in kind_nodes if node in nodes}
        self._overrides = dict(overrides or {})
        bad = [key for key in self._overrides if key not in self._entries]
        if bad:
            raise ValueError(f"overrides {bad} name no bound (block, node) of this binding")
        for name, (module, _, _) in chosen.items():
            _check_module(name, module)
        self.blocks: tuple[str, ...] = tuple(chosen)  # the modules running the chain, in module order
        self._modules = {name: module for name, (module, _, _) in chosen.items()}
        for name, (module, _, chain) in chosen.items():
            module.forward = _BoundForward(self, name, module, chain)

    # -------------------------------------------------------------------------------------------- dispatch

    def _run(self, block: str, node: str, args: tuple) -> Any:
        entry = self._entries.get((block, node))
        if entry is None:
            out = REFERENCE_OPS[node](*args)
        else:
            op = self._overrides.get((block, node))
            reason = None if op is not None else CANDIDATE_CHECKS[node](*args)
            if reason is not None and self.strict:
                raise NodeFallback(f"{block}/{node}: the candidate cannot run: {reason} (strict mode; "
                                   "bind(..., strict=False) falls back to the reference op and records why)")
            if reason is not None:
                entry["fallback"] = entry["fallback"] or reason
                out = REFERENCE_OPS[node](*args)
            else:
                try:
                    out = (op or CANDIDATE_OPS[node])(*args)
                except KernelInputError as err:
                    raise KernelInputError(f"{block}/{node}: {err}") from err
                entry["forward"] += 1
                self._count_backward(entry, out)
        if self.observer is not None:
            self.observer(block, node, args, out)
        return out

    @staticmethod
    def _count_backward(entry: dict, out: Any) -> None:
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                def hook(grad: torch.Tensor) -> None:
                    entry["backward"] += 1

                t.register_hook(hook)
                return  # one hook per execution: the first differentiable output stands for the node

    # -------------------------------------------------------------------------------------------- reports

    @property
    def ledger(self) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (block, node), entry in self._entries.items():
            out.setdefault(block, {})[node] = dict(entry)
        return out

    def missing(self) -> list[str]:
        return [f"{block}/{node}" for (block, node), e in self._entries.items() if not (e["forward"] and e["backward"])]

    def reset_ledger(self) -> None:
        for entry in self._entries.values():
            entry.update(forward=0, backward=0, fallback=None)

    def describe(self) -> dict[str, Any]:
        sha, files = _sources_sha256()
        blocks: dict[str, list[str]] = {name: [] for name in self.blocks}
        for block, node in self._entries:
            blocks[block].append(node)
        bound = {node for _, node in self._entries}
        return {
            "nodes": [node for node in ALL_NODES if node in bound],
            "blocks": blocks,
            "strict": self.strict,
            "overrides": [f"{block}/{node}" for block, node in self._overrides],
            "torch": torch.__version__,
            "triton": triton.__version__,
            "h3kernels_sha256": sha,
            "h3kernels_files": files,
        }

    # -------------------------------------------------------------------------------------------- unbind

    def unbind(self) -> None:
        for module in self._modules.values():
            if isinstance(module.__dict__.get("forward"), _BoundForward):
                del module.forward
        self._modules = {}

    def __enter__(self) -> Binding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unbind()


def bind(model: torch.nn.Module, nodes: Collection[str] = ALL_NODES, *, strict: bool = True,
         blocks: Collection[str] | None = None, overrides: Mapping[tuple[str, str], Callable] | None = None,
         observer: Observer | None = None) -> Binding:
    """Bind the candidate ops of `nodes` into `model`'s blocks (see the module docstring)."""
    return Binding(model, nodes, strict=strict, blocks=blocks, overrides=overrides, observer=observer)


def unbind(model: torch.nn.Module) -> None:
    """Remove every binding's instance forward from `model` (a no-op on a model that is not bound)."""
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, _BoundForward):
            bound.binding.unbind()


__all__ = ["ALL_NODES", "Binding", "NodeFallback", "bind", "unbind"]
