"""selftest: gate power. Reference (reused) -> calibrate -> mutants and false-reject probes through the gate.

Writes ``runs/<reference_id>-selftest/selftest.json`` and ``report.html`` (the baseline candidate's drift report
with a self-test section); see ``tasks.selftest`` for what each number means.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from pydantic import BaseModel, Field

from flows.calibrate import CalibrateParams, calibrate_flow
from flows.reference import ReferenceParams, reference_flow
from tasks import model as model_lib
from tasks import mutants as mutants_lib
from tasks import steps


class SelftestParams(ReferenceParams):
    mutants: list[str] = Field(default_factory=list, description="Mutants to run (empty: the whole library)")
    seed: int | None = Field(1, description="Sample seed of the second-seed probe (None: skip that probe)")


class SelftestResult(BaseModel):
    reference_id: str
    summary: dict[str, Any]
    findings: list[str] = Field(default_factory=list)
    mutants: list[dict[str, Any]] = Field(default_factory=list)
    probes: list[dict[str, Any]] = Field(default_factory=list)
    run_id: str
    report_url: str

    @property
    def must_catch_escaped(self) -> list[str]:
        return list(self.summary.get("must_catch_escaped", []))


@flow(name="h3-selftest", log_prints=True)
def selftest_flow(params: SelftestParams | None = None) -> SelftestResult:
    """Does the gate catch realistic kernel bugs, and does it pass correct implementations?"""
    params = params or SelftestParams()
    fields = params.model_dump()
    # A mistyped mutant fails here, before minutes of reference runs
    mutants_lib.select(model_lib.get_preset(params.preset, params.overrides).config, params.mutants)

    # Reference and rule: every run reused when the store already holds it
    reference = reference_flow(ReferenceParams(**{k: fields[k] for k in ReferenceParams.model_fields}))
    calibrate_flow(CalibrateParams(store=params.store, preset=params.preset, device=params.device,
                                   reference_id=reference.reference_id))
    rule = steps.load_rule(params.store, reference)

    # Evidence and kernels, as the gate does
    checkpoint = steps.prepare_checkpoint(params.store, params.preset, params.overrides, params.checkpoint)
    steps.verify_evidence(params.store, reference, rule, checkpoint, params.preset, params.overrides)
    steps.prepare_extension(params.device)

    # Baseline, mutants, false-reject probes; selftest.json and the report
    doc = steps.selftest(params.store, reference, rule, params.preset, params.overrides, checkpoint, params.device,
                         params.mutants or None, params.seed)
    summary = doc["summary"]
    print(f"self-test {reference.reference_id}: {summary['caught']}/{summary['mutants']} mutants caught, "
          f"{summary['false_rejects']} false rejects; report {doc['report_url']}")
    return SelftestResult(reference_id=reference.reference_id, summary=summary, findings=doc["findings"],
                          mutants=doc["mutants"], probes=doc["probes"], run_id=doc["run_id"],
                          report_url=doc["report_url"])
