"""Diagnostics of a candidate: node replacement by the reference, automatic localisation, isolation, conditioning.

Replacement configurations (``Replacement``): a set of (block, node) pairs that run diffusers' own op
(``REFERENCE_OPS[node]``) instead of the candidate inside the otherwise bound BF16 candidate model; the other
nodes run the candidate (or the caller's ``overrides``, e.g. a perturbed node: a replaced pair drops its
override). Replacing every pair binds ``nodes=()``: the model is then diffusers itself, bit for bit, and its
per-tensor errors are the default provider's stored report. With ``provider`` the replaced pairs run their
reference op inside ``activate(provider)``, entered and left around each forward call (their backward runs
under the default provider, except where the forward op chose its own backward kernel, as SDPA does).
Selectors: ``replace`` items are ``all``, a ``NODE_GROUPS`` name or a node name; ``blocks`` is ``None`` (every
bound module), a range/list of transformer-block indices (``"0-1"``, ``"0,2"``) or module names.

Each configuration gives a ``ConfigResult``: the gate's verdict (``tasks.gate.decide``, ensemble rule) and its
summary (passed, worst tensor and ratio, failing count, first drift).

Localisation (``localise``), from the baseline (every candidate node, with ``overrides``):
- target: on a fail, a configuration that passes; on a pass, one that keeps at least ``KEEP_REDUCTION`` of the
  worst-ratio reduction that replacing everything achieves (none if replacing everything does not lower it).
- bisect the bound modules (module order) with every node replaced, then the node groups within the chosen
  modules, then the nodes within the chosen groups: each step halves the current set and keeps the first half
  that meets the target (the half holding the first drift, or the worst isolated node, is tried first); it stops
  when neither half does. Every run is a step with its evidence (configuration, worst ratio, failing count).

Isolation and conditioning: ``tasks.diagnose_probes``. Document: ``diagnose_doc`` -> ``runs/<run_id>/diagnose.json``
with ``run_id = <reference_id>-diagnose-<sha256(request, candidate sources)[:12]>``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tasks import gate as gate_lib
from tasks import rules
from tasks.calibration import RuleFiles
from tasks.compare import canonical_json
from tasks.model import CheckpointRef, Preset
from tasks.providers import Provider, activate, resolve_provider
from tasks.reference import ReferenceInfo
from tasks.store import Store

Pair = tuple[str, str]
# A sub-configuration is good on a pass when it keeps half of the full replacement's worst-ratio reduction:
# enough to say "most of the error comes from here", loose enough that BF16 noise between runs does not decide.
KEEP_REDUCTION = 0.5
DIAGNOSE_SCHEMA = "h3gate.diagnose/1"


@dataclass(frozen=True)
class Replacement:
    """Which (block, node) pairs run the reference op, and under which provider (None: the default)."""

    label: str
    pairs: frozenset[Pair]
    provider: str | None = None

    def to_dict(self) -> dict[str, Any]:
        blocks: dict[str, list[str]] = {}
        for block, node in sorted(self.pairs):
            blocks.setdefault(block, []).append(node)
        return {"label": self.label, "provider": self.provider, "replaced": len(self.pairs), "blocks": blocks}


@dataclass
class ConfigResult:
    """One configuration's run: its verdict (kept in memory) and the summary that goes into diagnose.json."""

    config: Replacement
    verdict: rules.Verdict
    run: gate_lib.CandidateRun

    @property
    def worst_ratio(self) -> float:
        return self.verdict.tensor(self.verdict.worst).ratio if self.verdict.worst else math.inf

    @property
    def failing(self) -> int:
        return len(self.verdict.failures)

    def summary(self) -> dict[str, Any]:
        v = self.verdict
        drift = v.tensor(v.first_drift) if v.first_drift else None
        return {**self.config.to_dict(), "passed": v.passed, "worst": v.worst, "worst_ratio": self.worst_ratio,
                "failing": self.failing, "first_failure": v.failures[0] if v.failures else None,
                "first_drift": v.first_drift, "first_drift_order": drift.order if drift else None,
                "wall_s": round(self.run.wall_s, 3)}


@dataclass
class Context:
    """What every configuration run shares: store, reference, rule, model identity and the caller's overrides."""

    store: Store
    reference: ReferenceInfo
    rule: RuleFiles
    preset: Preset
    checkpoint: CheckpointRef
    device: str
    units: dict[str, tuple[str, ...]]  # bound module -> its nodes, in module order
    overrides: Mapping[Pair, Callable[..., Any]] = field(default_factory=dict)
    runs: list[ConfigResult] = field(default_factory=list)

    @property
    def all_pairs(self) -> frozenset[Pair]:
        return frozenset((b, n) for b, nodes in self.units.items() for n in nodes)


def bound_units(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every module the binding runs as a node chain, with its node names (``Binding.describe()['blocks']``)."""
    from h3kernels import bind

    with bind(model) as binding:
        return {block: tuple(nodes) for block, nodes in binding.describe()["blocks"].items()}


def select_nodes(replace: Sequence[str]) -> tuple[str, ...]:
    """Node names of ``replace`` items (``all``, group names, node names); unknown items raise ValueError."""
    from h3kernels.nodes import ALL_NODES, NODE_GROUPS

    out: list[str] = []
    for item in replace:
        if item == "all":
            out += ALL_NODES
        elif item in NODE_GROUPS:
            out += NODE_GROUPS[item]
        elif item in ALL_NODES:
            out.append(item)
        else:
            raise ValueError(f"--replace {item!r} is not 'all', a node group {sorted(NODE_GROUPS)} or a node name")
    return tuple(dict.fromkeys(out))


def select_blocks(units: Collection[str], blocks: str | Sequence[str] | None) -> tuple[str, ...]:
    """Bound module names of ``blocks``: None = all; ``"0-1"``/``"0,2"`` = transformer blocks; or module names."""
    if blocks is None or blocks == "":
        return tuple(units)
    items = [b.strip() for b in (blocks.split(",") if isinstance(blocks, str) else blocks) if b.strip()]
    out: list[str] = []
    for item in items:
        span = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        names = ([f"transformer_blocks.{i}" for i in range(int(span[1]), int(span[2] or span[1]) + 1)] if span
                 else [item])
        unknown = [n for n in names if n not in units]
        if unknown:
            raise ValueError(f"blocks {unknown} are not bound modules of this model; known: {list(units)}")
        out += names
    return tuple(dict.fromkeys(out))


def replacement(ctx: Context, nodes: Collection[str], blocks: Collection[str], label: str | None = None,
                provider: str | None = None) -> Replacement:
    pairs = frozenset((b, n) for b in blocks for n in ctx.units[b] if n in nodes)
    return Replacement(label or f"{'+'.join(nodes) if len(nodes) < 4 else f'{len(nodes)} nodes'} in "
                       f"{_span(blocks, ctx.units)}", pairs, provider)


def _span(blocks: Collection[str], units: Collection[str]) -> str:
    return "all modules" if set(blocks) == set(units) else ",".join(blocks)


def _under(provider: Provider, device: str, op: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        with activate(provider, device):  # per call: activate changes global torch/diffusers state
            return op(*args)

    return wrapped


def run_config(ctx: Context, config: Replacement) -> ConfigResult:
    """Run the candidate with ``config``'s pairs replaced; decide with the ensemble rule; record it in ctx.runs."""
    from h3kernels import ALL_NODES
    from h3kernels.nodes import REFERENCE_OPS

    if config.pairs == ctx.all_pairs and config.provider is None:
        nodes, overrides = (), None  # everything replaced: the bound model is diffusers itself
    else:
        provider = resolve_provider(config.provider, ctx.device) if config.provider else None
        overrides = {pair: op for pair, op in ctx.overrides.items() if pair not in config.pairs}
        for block, node in config.pairs:
            op = REFERENCE_OPS[node]
            overrides[(block, node)] = _under(provider, ctx.device, op) if provider is not None else op
        nodes = ALL_NODES
    run = gate_lib.run_candidate(ctx.store, ctx.reference, ctx.preset, ctx.checkpoint, device=ctx.device,
                                 nodes=nodes, overrides=overrides)
    result = ConfigResult(config, gate_lib.decide(ctx.store, ctx.rule, run), run)
    ctx.runs.append(result)
    return result


def baseline(ctx: Context) -> ConfigResult:
    return run_config(ctx, Replacement("candidate (nothing replaced)", frozenset()))


# ------------------------------------------------------------------------------------------------ localisation


def _block_of(tensor: str | None, units: Collection[str]) -> str | None:
    """The bound module a tensor name belongs to (longest prefix match), e.g. grad/transformer_blocks.1.ff..."""
    if tensor is None:
        return None
    path = tensor.split("/", 1)[-1]
    hits = [u for u in units if path == u or path.startswith(u + ".")]
    return max(hits, key=len) if hits else None


def _bisect(items: list, make: Callable[[list], Replacement], good: Callable[[ConfigResult], bool],
            ctx: Context, steps: list[dict], stage: str, first: Callable[[list], bool]) -> list:
    while len(items) > 1:
        half = len(items) // 2
        halves = [items[:half], items[half:]]
        halves.sort(key=lambda h: not first(h))  # the half holding the prior suspect first
        for candidate in halves:
            result = run_config(ctx, make(candidate))
            ok = good(result)
            steps.append({"stage": stage, "items": list(candidate), "meets_target": ok, **result.summary()})
            if ok:
                items = candidate
                break
        else:
            break
    return items


def localise(ctx: Context, base: ConfigResult, everything: ConfigResult,
             suspect_nodes: Sequence[str] = ()) -> dict[str, Any]:
    """The smallest replacement (modules, then groups, then nodes) that meets the target (module docstring)."""
    from h3kernels.nodes import NODE_GROUPS

    failing = not base.verdict.passed
    r0, r_all = base.worst_ratio, everything.worst_ratio
    steps: list[dict] = []
    out: dict[str, Any] = {"mode": "fail -> pass" if failing else "lower the worst ratio", "baseline_ratio": r0,
                           "all_replaced_ratio": r_all, "steps": steps}
    if failing and not everything.verdict.passed:
        return {**out, "found": False, "why": "replacing every node does not pass: the failure is not in the nodes"}
    if not failing and not r_all < r0:
        return {**out, "found": False, "why": "replacing every node does not lower the worst ratio"}

    def good(result: ConfigResult) -> bool:
        return result.verdict.passed if failing else (r0 - result.worst_ratio) >= KEEP_REDUCTION * (r0 - r_all)

    drift_unit = _block_of(base.verdict.first_drift, ctx.units)
    nodes_all = [n for nodes in NODE_GROUPS.values() for n in nodes]
    blocks = _bisect(list(ctx.units), lambda bs: replacement(ctx, nodes_all, bs), good, ctx, steps, "blocks",
                     lambda bs: drift_unit in bs)
    present = {n for b in blocks for n in ctx.units[b]}
    groups = [g for g, nodes in NODE_GROUPS.items() if present & set(nodes)]
    groups = _bisect(groups, lambda gs: replacement(ctx, [n for g in gs for n in NODE_GROUPS[g]], blocks,
                                                    f"{'+'.join(gs)} in {_span(blocks, ctx.units)}"),
                     good, ctx, steps, "groups", lambda gs: any(set(NODE_GROUPS[g]) & set(suspect_nodes) for g in gs))
    nodes = [n for g in groups for n in NODE_GROUPS[g] if n in present]
    nodes = _bisect(nodes, lambda ns: replacement(ctx, ns, blocks), good, ctx, steps, "nodes",
                    lambda ns: bool(set(ns) & set(suspect_nodes)))
    return {**out, "found": True, "blocks": list(blocks), "groups": list(groups), "nodes": list(nodes),
            "runs": len(steps) + 2}


# ------------------------------------------------------------------------------------------------ entry point


def run_id_for(reference: ReferenceInfo, request: Mapping[str, Any], candidate_sha: str | None) -> str:
    digest = hashlib.sha256(json.dumps([dict(request), candidate_sha], sort_keys=True, default=str).encode())
    return f"{reference.reference_id}-diagnose-{digest.hexdigest()[:12]}"


def run_diagnose(store: Store, reference: ReferenceInfo, rule: RuleFiles, preset: Preset, checkpoint: CheckpointRef,
                 *, device: str, replace: Sequence[str] = (), blocks: str | Sequence[str] | None = None,
                 provider_variant: str | None = None, provider_nodes: Sequence[str] = (), auto: bool = False,
                 overrides: Mapping[Pair, Callable[..., Any]] | None = None, conditioning: bool = True,
                 ) -> Diagnosis:
    """Baseline, the requested configurations, optional localisation, isolation and conditioning.

    ``overrides`` (block, node) -> op go into every run (a perturbed node, for tests and what-ifs); a replaced
    pair drops its override. Returns the diagnose.json document (``doc``, written by ``write_diagnose``) and
    every configuration's in-memory result (``runs``, in the order they ran).
    """
    from tasks import diagnose_probes as probes
    from tasks.model import load_model

    fp32_model = load_model(store, checkpoint, torch.float32, device)
    ctx = Context(store, reference, rule, preset, checkpoint, device, bound_units(fp32_model), dict(overrides or {}))
    chosen_blocks = select_blocks(ctx.units, blocks)
    configs = []
    if replace:
        configs.append(replacement(ctx, select_nodes(replace), chosen_blocks))
    if provider_variant:
        nodes = select_nodes(provider_nodes or ["all"])
        configs.append(replacement(ctx, nodes, chosen_blocks, provider=provider_variant,
                                   label=f"{'+'.join(provider_nodes) or 'all'} in {_span(chosen_blocks, ctx.units)}"
                                   f" under {provider_variant}"))
    base = baseline(ctx)
    results = [run_config(ctx, c) for c in configs]
    isolation_blocks = probes.path_blocks(base.verdict.first_drift, int(preset.config["num_layers"]))
    isolation = [probes.isolate_block(store, reference, checkpoint, fp32_model, i, device=device,
                                      overrides=ctx.overrides, comparisons=base.run.comparisons, rule=rule.rule)
                 for i in isolation_blocks]
    localisation = None
    if auto:
        everything = next((r for r in results if r.config.pairs == ctx.all_pairs and r.config.provider is None),
                          None) or run_config(ctx, replacement(ctx, select_nodes(["all"]), ctx.units, "everything"))
        suspects = [n["node"] for block in isolation for n in sorted(block["nodes"], key=lambda n: -n["ratio"])][:1]
        localisation = localise(ctx, base, everything, suspects)
    cond = probes.attention_conditioning(store, reference, preset, fp32_model, device) if conditioning else []
    request = {"replace": list(replace), "blocks": blocks if blocks is None or isinstance(blocks, str)
               else list(blocks), "provider_variant": provider_variant, "provider_nodes": list(provider_nodes),
               "auto": auto, "overrides": sorted(f"{b}/{n}" for b, n in ctx.overrides)}
    candidate_sha = base.run.candidate.get("h3kernels_sha256")
    doc = json.loads(canonical_json({
        "schema": DIAGNOSE_SCHEMA, "run_id": run_id_for(reference, request, candidate_sha),
        "reference_id": reference.reference_id, "device": device, "request": request,
        "candidate_sha256": candidate_sha, "rule": {"k": rule.rule.k, "floor": rule.rule.floor},
        "baseline": base.summary(), "configurations": [r.summary() for r in results],
        "localisation": localisation, "isolation": isolation, "conditioning": cond,
        "runs": [r.summary() for r in ctx.runs],
    }))
    return Diagnosis(doc, ctx.runs)


@dataclass
class Diagnosis:
    """diagnose.json (strict JSON: non-finite floats as strings) and the runs behind it."""

    doc: dict[str, Any]
    runs: list[ConfigResult]


def write_diagnose(store: Store, doc: Mapping[str, Any]) -> str:
    """runs/<run_id>/diagnose.json; returns its sha256."""
    return store.write_document(doc["run_id"], "diagnose.json", dict(doc)).sha256
