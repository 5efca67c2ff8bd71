"""The candidate gate's plain steps: verify the evidence, run the bound candidate, decide.

1. ``verify_evidence``: every blob of every run of the reference, the inventory, the calibrated rule,
   the thresholds and the checkpoint are re-hashed *before any model runs*; the first bad one stops
   the gate with its name and expected/actual hash.
2. ``prepare_extension``: imports the candidate and runs each kernel once on tiny inputs of the
   run's dtype and device (Triton compiles, or the interpreter is exercised), recording versions.
3. (golden tests: ``tasks.golden``.)
4. ``run_candidate``: loads the BF16 model, binds every candidate node strictly, runs one forward +
   backward with the reference's sample and upstream gradients, and compares each tensor with the
   FP32 reference *as it is produced* (``CompareSink``); candidate tensors are stored only with
   ``keep_candidate``. The ledger must show every bound node ran forward and backward. The reference
   tensors are read ahead on threads and, when the memory plan has room beside the run, preloaded onto
   its device before the timed pass (``ReferenceFeed``): ``wall_s`` is the pass, ``reference_load_s``
   the preload.
5. ``decide``: the ensemble-rule verdict (worst tensor, first drift in the candidate's real
   execution order, failures in that order), the single-provider record alongside.
Everything the gate decides is written under ``runs/<gate_id>/`` (verdict.json, ledger.json).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tasks import rules
from tasks.calibration import NOT_GATED_KINDS, RuleFiles, single_bounds
from tasks.capture import DTYPES, PeakMemory, StoreSink, run_capture
from tasks.compare import TensorComparison, canonical_json, compare_tensors
from tasks.memory_plan import plan_memory
from tasks.model import CheckpointRef, Preset, load_model, read_sample, verify_checkpoint
from tasks.placement import Placement
from tasks.prefetch import TensorPrefetcher
from tasks.providers import Provider, activate, resolve_provider
from tasks.reference import INVENTORY_FILE, ReferenceInfo
from tasks.store import Store

CANDIDATE_DTYPE = "bfloat16"


class GateError(RuntimeError):
    """The gate cannot reach a verdict (bad evidence, mismatched configs, a node that did not run)."""


def verify_evidence(store: Store, reference: ReferenceInfo, rule: RuleFiles, checkpoint: CheckpointRef) -> int:
    """Re-hash everything the verdict will rest on; return the number of blobs checked."""
    pointer = store.read_ref("references", reference.reference_id)
    if pointer is None:
        raise GateError(f"reference {reference.reference_id} is not in the store")
    store.get_json(reference.inventory_sha, name=f"{reference.reference_id}/{INVENTORY_FILE}")
    checked = 1
    runs = [reference.fp32_run, *reference.provider_runs.values()]
    runs += [reference.fp32_alt_run] if reference.fp32_alt_run else []
    for run_id in runs:
        report = store.verify_run(run_id)
        report.raise_for_errors()
        checked += report.ok_count
    store.get_json(rule.rule_sha, name=f"{reference.reference_id}/ensemble-rule.json")
    store.get_json(rule.thresholds_sha, name=f"{reference.reference_id}/thresholds.json")
    for provider, sha in rule.reports.items():
        store.get_json(sha, name=f"{reference.reference_id}/report-{provider}.json")
    if rule.rule.reference_manifest_sha != store.manifest_sha(reference.fp32_run):
        raise GateError(
            f"the rule of {reference.reference_id} was calibrated on FP32 manifest "
            f"{rule.rule.reference_manifest_sha}, but the reference's FP32 run now has "
            f"{store.manifest_sha(reference.fp32_run)}: recalibrate (`h3gate calibrate`)"
        )
    if checkpoint.sha256 != reference.checkpoint_sha:
        raise GateError(
            f"checkpoint {checkpoint.sha256[:12]} is not the one the reference was made with "
            f"({reference.checkpoint_sha[:12]}): regenerate the reference or pass its checkpoint"
        )
    verify_checkpoint(store, checkpoint)
    return checked + len(rule.reports) + 2 + len(checkpoint.weights)


def prepare_extension(device: str) -> dict[str, Any]:
    """Compile (or interpret) every candidate kernel once on tiny inputs; return the candidate's identity."""
    from h3kernels import attention, modulation, norm, qk_norm_rope, residual, swiglu

    dev = torch.device(device)
    dtype = DTYPES[CANDIDATE_DTYPE]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=dev, dtype=dt).requires_grad_(True)

    started = time.perf_counter()
    s, h, nh, d = 8, 64, 2, 32
    idx = torch.zeros(s, dtype=torch.long, device=dev)
    table = modulation.adaln_table(rand(1, 16, dt=torch.float32), rand(18 * h, 16), rand(18 * h))
    outputs = [
        norm.rms_norm_modulate(rand(s, h), rand(h), table, idx, 0, 1, 1e-5),
        residual.gated_residual(rand(s, h), rand(s, h), table, idx, 2),
        norm.rms_norm(rand(s, h), rand(h), 1e-5),
        qk_norm_rope.qk_norm_rope(rand(s, nh, d), rand(d), None, None, 1e-5),
        swiglu.swiglu(rand(s, 2 * h)),
        attention.attention(rand(1, s, nh, d), rand(1, s, nh, d), rand(1, s, nh, d)),
    ]
    sum(out.float().sum() for out in outputs).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__, "warm_s": round(time.perf_counter() - started, 3)}


class CompareSink:
    """Compares each candidate tensor with its FP32 reference the moment it is produced.

    ``fetch(name, device)`` hands over the verified reference tensor on the device the candidate tensor was
    produced on (a split model's devices); each is dropped after its comparison. ``keep`` also stores the
    candidate's tensors.
    """

    def __init__(self, reference_tensors: Mapping[str, Mapping[str, Any]],
                 fetch: Callable[[str, torch.device], torch.Tensor], keep: StoreSink | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.reference = reference_tensors
        self.fetch = fetch
        self.keep = keep
        self.progress = progress
        self.comparisons: dict[str, TensorComparison] = {}
        self.order: dict[str, int] = {}
        self.unexpected: list[str] = []

    def __call__(self, name: str, kind: str, order: int, tensor: torch.Tensor) -> None:
        if self.keep is not None:
            self.keep(name, kind, order, tensor)
        if kind in NOT_GATED_KINDS:
            return
        if name not in self.reference:
            self.unexpected.append(name)
            return
        reference = self.fetch(name, tensor.device)
        self.comparisons[name] = compare_tensors(name, tensor, reference)
        self.order[name] = order
        del reference
        if self.progress is not None:
            self.progress(len(self.comparisons))


class ReferenceFeed:
    """The FP32 reference tensors of a candidate run, read ahead (``tasks.prefetch``) and verified.

    ``preload_on`` (the reference fits beside the run on its one device, by the memory plan) reads all of them
    onto that device before the pass, so the timed forward+backward waits on no storage read; otherwise they
    stream during the pass and move to each tensor's device on use. Either way the host holds at most the
    prefetch window (``tasks.prefetch.DEFAULT_WINDOW_BYTES``) of them at once.
    """

    def __init__(self, store: Store, records: Mapping[str, Mapping[str, Any]], preload_on: str | None) -> None:
        items = [(n, r["sha256"], r["bytes"]) for n, r in sorted(records.items(), key=lambda kv: kv[1]["order"])]
        self.bytes = sum(nbytes for _, _, nbytes in items)
        self.preloaded_on = preload_on
        self._resident: dict[str, torch.Tensor] = {}
        self._prefetch = TensorPrefetcher(store, items)
        started = time.perf_counter()
        if preload_on is not None:
            self._resident = {name: self._prefetch.get(name).to(preload_on) for name, _, _ in items}
            if torch.device(preload_on).type == "cuda":
                torch.cuda.synchronize(preload_on)
        self.load_s = time.perf_counter() - started

    def __call__(self, name: str, device: torch.device) -> torch.Tensor:
        tensor = self._resident.pop(name, None)
        return tensor.to(device) if tensor is not None else self._prefetch.get(name).to(device)

    def close(self) -> None:
        self._resident.clear()
        self._prefetch.close()


def preload_device(reference_bytes: int, preset: Preset, placement: Placement, provider: Provider,
                   granularity: str) -> str | None:
    """The device to preload the reference onto: the run's one device when the plan has room, else None."""
    if len(set(placement.devices)) != 1:
        return None
    (plan,) = plan_memory(preset, CANDIDATE_DTYPE, placement, provider=provider, granularity=granularity).devices
    return plan.device if plan.total + reference_bytes <= plan.usable else None


@dataclass
class CandidateRun:
    """What one bound candidate run produced (small: metrics, not tensors)."""

    comparisons: dict[str, TensorComparison]
    order: dict[str, int]
    ledger: dict[str, dict[str, dict[str, Any]]]
    missing_nodes: list[str]
    candidate: dict[str, Any]
    wall_s: float
    peak_device_bytes: int | None
    kept_run: str | None = None
    reference_load_s: float = 0.0
    reference_preloaded_on: str | None = None
    unexpected: list[str] = field(default_factory=list)


def run_candidate(
    store: Store,
    reference: ReferenceInfo,
    preset: Preset,
    checkpoint: CheckpointRef,
    *,
    device: str,
    nodes: Collection[str] | None = None,
    overrides: Mapping[tuple[str, str], Callable[..., Any]] | None = None,
    keep_candidate: bool = False,
    progress: Callable[[int, int], None] | None = None,
    placement: Placement | None = None,
) -> CandidateRun:
    """Run the strictly bound BF16 candidate once, comparing every tensor against the FP32 reference.

    ``placement`` splits the candidate model over devices like a reference run (first device: ``device``).
    """
    from h3kernels import ALL_NODES, bind

    fp32_manifest = store.read_manifest(reference.fp32_run)
    ref_tensors = fp32_manifest["tensors"]
    granularity = fp32_manifest["identity"]["granularity"]
    sample = read_sample(store, reference.sample_sha, preset.config)
    placement = placement or Placement.single(device, preset.config["num_layers"])
    device = placement.main_device
    model = load_model(store, checkpoint, DTYPES[CANDIDATE_DTYPE], device, placement)
    binding = bind(model, tuple(nodes) if nodes is not None else ALL_NODES, strict=True, overrides=overrides)
    candidate = binding.describe()
    keep = StoreSink(store) if keep_candidate else None
    # The candidate runs under the default provider: the nodes it does not replace are diffusers' own.
    provider = resolve_provider(reference.default_provider, device)
    gated_records = {n: r for n, r in ref_tensors.items() if r["kind"] not in NOT_GATED_KINDS}
    preload_on = preload_device(sum(r["bytes"] for r in gated_records.values()), preset, placement, provider,
                                granularity)
    feed = None
    try:
        feed = ReferenceFeed(store, gated_records, preload_on)
        sink = CompareSink(ref_tensors, feed, keep,
                           progress=(lambda done: progress(done, len(gated_records))) if progress else None)
        started = time.perf_counter()
        with activate(provider, device), PeakMemory(placement.devices) as memory:
            run_capture(model, sample, sink, device=device, granularity=granularity)
        wall_s = time.perf_counter() - started
    finally:
        binding.unbind()
        if feed is not None:
            feed.close()
    kept_run = _write_candidate_manifest(store, reference, candidate, keep) if keep is not None else None
    return CandidateRun(
        comparisons=sink.comparisons,
        order=sink.order,
        ledger=binding.ledger,
        missing_nodes=binding.missing(),
        candidate=candidate,
        wall_s=wall_s,
        peak_device_bytes=memory.peak,
        kept_run=kept_run,
        unexpected=sink.unexpected,
        reference_load_s=feed.load_s,
        reference_preloaded_on=feed.preloaded_on,
    )


def _write_candidate_manifest(store: Store, reference: ReferenceInfo, candidate: Mapping[str, Any],
                              keep: StoreSink) -> str:
    run_id = f"{reference.reference_id}-cand-{_digest(candidate)[:12]}"
    store.write_manifest(run_id, {"run_id": run_id, "tensors": keep.records,
                                  "identity": {"reference": reference.reference_id, "candidate": dict(candidate)},
                                  "metadata": {}}, overwrite=True)
    return run_id


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def gate_id(reference: ReferenceInfo, rule: RuleFiles, candidate: Mapping[str, Any]) -> str:
    """A gate is identified by what it judged: the reference, the rule and the candidate."""
    return f"{reference.reference_id}-gate-{_digest([rule.rule_sha, dict(candidate)])[:12]}"


def decide(store: Store, rule: RuleFiles, run: CandidateRun) -> rules.Verdict:
    """The ensemble-rule verdict of a candidate run, with the single-provider record alongside.

    A rule tensor the candidate never produced fails the verdict; it is ordered after everything
    that ran so first drift stays within the real execution order.
    """
    order = dict(run.order)
    last = max(order.values(), default=0)
    for offset, name in enumerate(sorted(set(rule.rule.max_provider_error) - set(order)), start=1):
        order[name] = last + offset
    return rules.verdict(
        run.comparisons,
        rule.rule,
        order,
        single_bounds=single_bounds(store, rule),
        ledger_missing=run.missing_nodes,
    )


def write_gate_documents(store: Store, gid: str, verdict: rules.Verdict, run: CandidateRun,
                         extra: Mapping[str, Any]) -> dict[str, str]:
    """verdict.json and ledger.json under runs/<gate_id>/; returns their sha256.

    A passing verdict also points ``refs/passing-verdicts/<passing_verdict_key(...)>`` at itself (the
    latest pass per preset, device type, checkpoint and candidate; the generation gate needs one). The
    reference is found from ``extra["reference_id"]``; without it no pointer is written.
    """
    verdict_doc = json.loads(canonical_json({**verdict.to_dict(), **extra}))
    ledger_doc = json.loads(canonical_json({"ledger": run.ledger, "missing": run.missing_nodes,
                                            "candidate": run.candidate, "unexpected": run.unexpected}))
    documents = {
        "verdict": store.write_document(gid, "verdict.json", verdict_doc).sha256,
        "ledger": store.write_document(gid, "ledger.json", ledger_doc).sha256,
    }
    reference = store.read_ref("references", extra["reference_id"]) if extra.get("reference_id") else None
    if verdict.passed and reference is not None:
        key = passing_verdict_key(reference["preset"], reference["device_type"], reference["checkpoint_sha"],
                                  run.candidate)
        store.write_ref(PASSING_VERDICTS, key, {"gate_id": gid, "verdict_sha": documents["verdict"],
                                                "reference_id": reference["reference_id"]})
    return documents


PASSING_VERDICTS = "passing-verdicts"


def passing_verdict_key(preset: str, device_type: str, checkpoint_sha: str, candidate: Mapping[str, Any]) -> str:
    """Name of the pointer to the latest passing verdict of (preset, device type, checkpoint, candidate).

    ``candidate`` is ``Binding.describe()`` of the strictly bound candidate, without overrides.
    """
    return f"{preset}-{device_type}-{checkpoint_sha[:12]}-{_digest(dict(candidate))[:12]}"
