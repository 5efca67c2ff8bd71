"""The candidate gate: verify the evidence, warm the kernels, golden tests, the bound model, the verdict."""

from __future__ import annotations

from typing import Any

import torch
from prefect import flow
from pydantic import BaseModel, Field

from flows.common import StoreParams
from tasks import steps
from tasks.placement import lane_target, lanes


class GateParams(StoreParams):
    reference_id: str | None = Field(None, description="Reference to gate against (default: the preset's current)")
    nodes: list[str] = Field(default_factory=list, description="Candidate nodes to bind (empty: every node)")
    keep_candidate: bool = Field(False, description="Also store the candidate's tensors (default: compare only)")


class GateResult(BaseModel):
    passed: bool
    gate_id: str | None
    reference_id: str
    report_url: str | None
    stage: str = Field(description="Where the gate stopped: golden or verdict")
    worst: dict[str, Any] | None = None
    first_drift: dict[str, Any] | None = None
    failures: list[str] = Field(default_factory=list)
    ledger_missing: list[str] = Field(default_factory=list)
    golden_failed: list[str] = Field(default_factory=list)


@flow(name="h3-gate", log_prints=True)
def gate_flow(params: GateParams | None = None) -> GateResult:
    """Gate the candidate kernels against the stored reference with the calibrated ensemble rule."""
    params = params or GateParams()
    store, preset, overrides, device = params.store, params.preset, params.overrides, params.device

    # 1. Evidence: reference, rule and checkpoint verified before any model runs
    reference = steps.resolve_reference(store, preset, device, params.reference_id)
    rule = steps.load_rule(store, reference)
    checkpoint = steps.prepare_checkpoint(store, preset, overrides, params.checkpoint)
    steps.verify_evidence(store, reference, rule, checkpoint, preset, overrides)

    # 2. Extension: compile / warm every kernel (GPU work carries the `gpu` tag: a concurrency limit applies)
    gpu = steps.gpu_tags(device)
    extension = steps.prepare_extension.with_options(tags=gpu)(device)

    # 3. Golden tests on block 0; stop on any failure
    golden = steps.golden_tests.with_options(tags=gpu)(store, reference, preset, overrides, checkpoint, device)
    golden_failed = [t["name"] for t in golden["tests"] if t["outcome"] == "failed"]
    if golden_failed:
        print(f"golden tests failed: {', '.join(golden_failed)}; the full model was not run")
        return GateResult(passed=False, gate_id=None, reference_id=reference.reference_id, report_url=None,
                          stage="golden", golden_failed=golden_failed)

    # 4-5. The bound candidate, every tensor compared as produced; the verdict
    #      (a split model: `split`, or the first group of `gpus_per_run` GPUs)
    visible = torch.cuda.device_count() if device == "cuda" else 0
    run_device, split = lane_target(lanes(device, params.split, params.gpus_per_run, visible)[0])
    run = steps.run_candidate.with_options(tags=gpu)(store, reference, preset, overrides, checkpoint, run_device,
                                                     params.nodes, params.keep_candidate, split)
    gid, verdict, documents = steps.decide(store, reference, rule, run, golden)

    # 6. Publish: report in the store, artifacts in Prefect
    identity = {
        "title": f"h3gate: {preset} on {device}", "gate": gid, "reference": reference.reference_id,
        "fp32 run": reference.fp32_run, "rule sha256": rule.rule_sha, "verdict sha256": documents["verdict"],
        "checkpoint sha256": checkpoint.sha256, "sample sha256": reference.sample_sha,
        "candidate sources sha256": run.candidate.get("h3kernels_sha256"), "triton": extension["triton"],
        "torch": extension["torch"], "candidate run": run.kept_run or "not stored (compared in flight)",
    }
    url = steps.publish_report(store, gid, verdict, reference, rule, identity)
    print(f"gate {gid}: {'PASS' if verdict['passed'] else 'FAIL'}; report {url}")
    return GateResult(
        passed=bool(verdict["passed"]), gate_id=gid, reference_id=reference.reference_id, report_url=url,
        stage="verdict", worst=verdict.get("worst"), first_drift=verdict.get("first_drift"),
        failures=list(verdict.get("failures", [])), ledger_missing=list(verdict.get("ledger_missing", [])),
    )
