"""Provider reports, spread and the calibrated rule files of a stored reference.

The store-bound half of the decision logic (``rules`` is the pure half):

- ``provider_reports``: every BF16 provider run against the FP32 run, tensor by tensor
  (``report-<provider>.json`` per provider), plus the FP32-alt run against the FP32 run, whose
  per-tensor errors are the FP32 reference's own rounding noise (``fp32-noise.json``).
- ``write_spread``: per tensor min/max/ratio of the provider errors and the outlier (``spread.json``).
- ``write_rule``: ``thresholds.json`` (single-provider bounds, with the hashes of the reports they
  came from) and ``ensemble-rule.json`` (k by leave-one-out, the floor from the FP32 noise, the
  reference manifest hash), and the pointer ``refs/rules/<reference_id>.json``.

Every document is content-addressed (a blob) and readable under ``runs/<reference_id>/``.
Golden-block inputs (``in/...``) are replay data, not model tensors: no report or rule covers them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks import rules
from tasks.compare import TensorComparison, canonical_json, compare_tensors
from tasks.prefetch import TensorPrefetcher
from tasks.reference import ReferenceInfo
from tasks.store import Store

NOT_GATED_KINDS = ("in",)
FP32_ALT = "fp32-alt"


def _strict(doc: Any) -> Any:
    """The JSON the store accepts: non-finite floats as strings, as every rules writer emits."""
    return json.loads(canonical_json(doc))


def gated_names(manifest: Mapping[str, Any]) -> list[str]:
    """The tensors of a run that rules cover, in execution order."""
    tensors = manifest["tensors"]
    names = [n for n, r in tensors.items() if r["kind"] not in NOT_GATED_KINDS]
    return sorted(names, key=lambda n: tensors[n]["order"])


def compare_stored_runs(
    store: Store, candidate_runs: Sequence[str], reference_run: str, *, device: str = "cpu"
) -> dict[str, list[TensorComparison]]:
    """Compare every gated tensor of each candidate run with ``reference_run``, in the reference's order.

    One sweep over the reference: each of its tensors is read (and its hash verified) once, however
    many runs are compared with it (at the block preset the FP32 run is ~10 GB); the reads run ahead of
    the comparisons on worker threads (``tasks.prefetch``).
    A tensor the reference has and a candidate lacks (or the other way round) is an error naming it.
    """
    if not candidate_runs:
        return {}
    ref_manifest = store.read_manifest(reference_run)
    names = gated_names(ref_manifest)
    manifests = {run: store.read_manifest(run)["tensors"] for run in candidate_runs}
    for run, cand in manifests.items():
        missing = [n for n in names if n not in cand]
        extra = [n for n, r in cand.items() if r["kind"] not in NOT_GATED_KINDS and n not in ref_manifest["tensors"]]
        if missing or extra:
            raise rules.RuleError(
                f"runs {run} and {reference_run} capture different tensors: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, extra {extra[:5]}"
            )
    out: dict[str, list[TensorComparison]] = {run: [] for run in candidate_runs}
    sources = {reference_run: ref_manifest["tensors"], **manifests}
    order = [(f"{run}/{name}", sources[run][name]) for name in names for run in (reference_run, *candidate_runs)]
    with TensorPrefetcher(store, [(key, rec["sha256"], rec["bytes"]) for key, rec in order]) as tensors:
        for name in names:
            reference = tensors.get(f"{reference_run}/{name}").to(device)
            for run in candidate_runs:
                candidate = tensors.get(f"{run}/{name}").to(device)
                out[run].append(compare_tensors(name, candidate, reference))
                del candidate
            del reference
    return out


@dataclass(frozen=True)
class ReportSet:
    """The provider reports of one reference: provider -> (report sha256, errors by tensor)."""

    reports: Mapping[str, str]
    errors: Mapping[str, Mapping[str, float]]
    fp32_noise: Mapping[str, float] | None
    order: Mapping[str, int]


def provider_reports(store: Store, reference: ReferenceInfo, *, device: str = "cpu") -> ReportSet:
    """Write (or reuse) ``report-<provider>.json`` for every provider and ``fp32-noise.json``.

    The reports not yet stored are computed together, in one sweep over the FP32 run.
    """
    wanted = {f"report-{provider}.json": (provider, run) for provider, run in reference.provider_runs.items()}
    if reference.fp32_alt_run is not None:
        wanted["fp32-noise.json"] = (FP32_ALT, reference.fp32_alt_run)
    stored = {filename: store.read_document(reference.reference_id, filename) for filename in wanted}
    reused = {f: doc for f, doc in stored.items() if doc is not None and doc.get("provider_run") == wanted[f][1]}
    todo = {f: pr for f, pr in wanted.items() if f not in reused}
    comparisons = compare_stored_runs(store, list(dict.fromkeys(run for _, run in todo.values())),
                                      reference.fp32_run, device=device)
    docs: dict[str, tuple[str, dict[str, Any]]] = {}
    for filename, (provider, run) in wanted.items():
        if filename in reused:  # already stored: put_json only re-derives the hash
            docs[filename] = (store.put_json(reused[filename]).sha256, reused[filename])
            continue
        doc = _strict(rules.provider_report(provider, comparisons[run], reference_run=reference.fp32_run,
                                            provider_run=run))
        docs[filename] = (store.write_document(reference.reference_id, filename, doc).sha256, doc)
    providers = sorted(reference.provider_runs)
    noise = docs.get("fp32-noise.json")
    manifest = store.read_manifest(reference.fp32_run)
    order = {n: manifest["tensors"][n]["order"] for n in gated_names(manifest)}
    return ReportSet({p: docs[f"report-{p}.json"][0] for p in providers},
                     {p: rules.errors_from_report(docs[f"report-{p}.json"][1]) for p in providers},
                     None if noise is None else rules.errors_from_report(noise[1]), order)


def write_spread(store: Store, reference: ReferenceInfo, reports: ReportSet) -> dict[str, dict[str, object]]:
    """``spread.json``: per tensor min/max/ratio/outlier of the provider errors."""
    table = rules.spread(reports.errors)
    store.write_document(reference.reference_id, "spread.json", _strict({"providers": sorted(reports.errors),
                                                                        "tensors": table}))
    return table


@dataclass(frozen=True)
class RuleFiles:
    """The calibrated rule of a reference and where its files are."""

    reference_id: str
    rule: rules.EnsembleRule
    rule_sha: str
    thresholds_sha: str
    reports: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "reference_id": self.reference_id,
            "rule_sha": self.rule_sha,
            "thresholds_sha": self.thresholds_sha,
            "reports": dict(self.reports),
            "k": self.rule.k,
        }


def write_rule(store: Store, reference: ReferenceInfo, reports: ReportSet) -> RuleFiles:
    """Calibrate on the providers, write thresholds.json and ensemble-rule.json, point refs/rules at them."""
    floor = rules.derive_floor(reports.fp32_noise)
    rule = rules.calibrate(
        reports.errors,
        floor,
        reference_manifest_sha=store.manifest_sha(reference.fp32_run),
        floor_method=rules.floor_method(reports.fp32_noise),
    )
    default = reference.default_provider
    bounds = rules.single_provider_bounds(reports.errors[default], floor)
    thresholds = rules.thresholds_json(bounds, reports.reports, floor=floor)
    thresholds_sha = store.write_document(reference.reference_id, "thresholds.json", _strict(thresholds)).sha256
    rule_sha = store.write_document(reference.reference_id, "ensemble-rule.json", _strict(rule.to_dict())).sha256
    files = RuleFiles(reference.reference_id, rule, rule_sha, thresholds_sha, reports.reports)
    store.write_ref("rules", reference.reference_id, files.to_json())
    return files


def load_rule(store: Store, reference_id: str) -> RuleFiles:
    """The calibrated rule of a reference, verified against its recorded hash."""
    pointer = store.read_ref("rules", reference_id)
    if pointer is None:
        raise LookupError(f"reference {reference_id} has no calibrated rule; run `h3gate calibrate` first")
    rule = rules.EnsembleRule.from_json(store.get_json(pointer["rule_sha"], name=f"{reference_id}/ensemble-rule.json"))
    store.get_json(pointer["thresholds_sha"], name=f"{reference_id}/thresholds.json")
    return RuleFiles(reference_id, rule, pointer["rule_sha"], pointer["thresholds_sha"], pointer["reports"])


def single_bounds(store: Store, files: RuleFiles) -> dict[str, float]:
    """The single-provider bounds (the record kept beside the ensemble rule)."""
    doc = store.get_json(files.thresholds_sha, name=f"{files.reference_id}/thresholds.json")
    return {name: float(bound) for name, bound in doc["bounds"].items()}
