"""The generation gate: after a passing numerical verdict, a full FL2VA sampling trajectory, candidate vs providers.

Stages: resolve the reference and checkpoint; refuse without the numerical gate's passing verdict for this
preset, device type, checkpoint and candidate; run the trajectories (FP32, FP32-alt, every BF16 provider of
the reference, the candidate twice) in one GPU-tagged task (tensors never leave it); write
``runs/<generate_id>/generate.json`` and report.html; publish a markdown verdict, the worst-tensor and per-step
tables and the report link as artifacts keyed ``generate-<preset>-<device type>-*``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel, Field

from flows.common import StoreParams
from tasks import generate as generate_lib
from tasks import model as model_lib
from tasks import reference as reference_lib
from tasks import steps
from tasks.providers import device_type_of
from tasks.store import Store


class GenerateParams(StoreParams):
    reference_id: str | None = Field(None, description="Reference of the numerical gate (default: current)")
    steps: int = Field(30, ge=2, description="Schedule points (set_timesteps); steps - 1 model evaluations")
    nodes: list[str] = Field(default_factory=list, description="Candidate nodes to bind (empty: every node)")


class GenerateResult(BaseModel):
    passed: bool
    generate_id: str
    gate_id: str
    report_url: str
    numerically_passed: bool
    deterministic: bool
    first_mismatch: dict[str, Any] | None = None
    first_failure: str | None = None
    first_failing_step: int | None = None
    worst_step: dict[str, Any] | None = None
    final: dict[str, Any] = Field(default_factory=dict)
    failures: list[str] = Field(default_factory=list)


@task(name="require-passing-verdict", **steps.STORE_RETRIES)
def require_passing_verdict(store_url: str | None, reference: reference_lib.ReferenceInfo, preset_name: str,
                            overrides: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """The numerical gate's passing verdict for this candidate, or a refusal naming what is missing."""
    preset = model_lib.get_preset(preset_name, overrides)
    candidate = generate_lib.candidate_identity(preset.config, nodes or None)
    return generate_lib.require_passing_verdict(Store.from_env(store_url), reference, candidate)


@task(name="run-generation")
def run_generation(store_url: str | None, reference: reference_lib.ReferenceInfo, preset_name: str,
                   overrides: dict[str, Any], checkpoint: model_lib.CheckpointRef, device: str, num_steps: int,
                   nodes: list[str]) -> dict[str, Any]:
    """Every trajectory, the calibrated rule, the verdict and the determinism check; writes generate.json."""
    logger = get_run_logger()
    store = Store.from_env(store_url)
    outcome = generate_lib.run_generate(store, reference, model_lib.get_preset(preset_name, overrides), checkpoint,
                                        device=device, num_steps=num_steps, nodes=nodes or None,
                                        progress=logger.info)
    generate_lib.write_generate_document(store, outcome)
    return {"generate_id": outcome.generate_id, "doc": outcome.doc, "provider_errors": outcome.provider_errors,
            "rule": outcome.rule, "verdict": outcome.verdict}


@task(name="publish-generation", **steps.STORE_RETRIES)
def publish_generation(store_url: str | None, result: dict[str, Any], key_prefix: str) -> str:
    """report.html into the store; verdict, worst-tensor, per-step and report-link artifacts."""
    from tasks import report as report_lib
    from tasks.generate_report import build_generate_report, step_table

    outcome = generate_lib.GenerateOutcome(**result)
    store = Store.from_env(store_url)
    url, _ = report_lib.store_report(store, build_generate_report(outcome), run_id=outcome.generate_id)
    doc = outcome.doc
    identity = {"title": f"generation gate, {doc['num_steps']} steps", "preset": doc["preset"]}
    report_lib.publish_artifacts(dict(outcome.verdict, passed=doc["passed"]), identity, url, key_prefix=key_prefix)
    create_table_artifact(table=step_table(doc), key=f"{key_prefix}-steps", _sync=True,
                          description="per-step velocity error of the candidate, its bound and their ratio")
    return url


@flow(name="h3-generate", log_prints=True)
def generate_flow(params: GenerateParams | None = None) -> GenerateResult:
    """Gate a full sampling trajectory of the candidate (after its numerical gate passed)."""
    params = params or GenerateParams()
    store, preset, overrides, device = params.store, params.preset, params.overrides, params.device

    # 1. Evidence: the reference, the checkpoint and the numerical gate's passing verdict (refuse without it)
    reference = steps.resolve_reference(store, preset, device, params.reference_id)
    checkpoint = steps.prepare_checkpoint(store, preset, overrides, params.checkpoint)
    pointer = require_passing_verdict(store, reference, preset, overrides, params.nodes)
    print(f"numerical gate {pointer['gate_id']} passed; sampling {params.steps} schedule points")

    # 2. Trajectories: FP32, FP32-alt, providers, candidate twice; rule, verdict, determinism
    result = run_generation.with_options(tags=steps.gpu_tags(device))(
        store, reference, preset, overrides, checkpoint, device, params.steps, params.nodes)
    doc = result["doc"]

    # 3. Publish: report in the store, artifacts in Prefect
    url = publish_generation(store, result, f"generate-{preset}-{device_type_of(device)}")
    print(f"generate {doc['generate_id']}: {'PASS' if doc['passed'] else 'FAIL'}; report {url}")
    return GenerateResult(
        passed=doc["passed"], generate_id=doc["generate_id"], gate_id=doc["gate_id"], report_url=url,
        numerically_passed=doc["numerically_passed"], deterministic=doc["determinism"]["deterministic"],
        first_mismatch=doc["determinism"]["first_mismatch"], first_failure=doc["first_failure"],
        first_failing_step=doc["first_failing_step"], worst_step=doc["worst_step"], final=doc["final"],
        failures=doc["failures"],
    )
