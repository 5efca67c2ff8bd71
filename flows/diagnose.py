"""diagnose: where does the candidate's error come from? Replacement by the reference, localisation, probes.

Evidence and kernels as the gate checks them, then ``steps.diagnose`` (``tasks.diagnose``): the baseline candidate,
the requested replacement configurations (``replace`` groups/nodes in ``blocks``; ``provider_variant`` on
``provider_nodes``), ``auto`` localisation, per-node isolation on the path to the first drift and the attention
conditioning of the FP32 reference. Writes ``runs/<reference_id>-diagnose-<hash>/diagnose.json`` and
``report.html``; publishes a markdown summary and a table artifact (keys ``diagnose-<preset>-<device type>``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from pydantic import BaseModel, Field

from flows.common import StoreParams
from tasks import steps


class DiagnoseParams(StoreParams):
    reference_id: str | None = Field(None, description="Reference to diagnose against (default: the preset's current)")
    auto: bool = Field(False, description="Bisect over blocks, node groups and nodes to the smallest replacement")
    replace: list[str] = Field(default_factory=list, description="Node groups or nodes to replace by the reference")
    blocks: str | None = Field(None, description="Transformer blocks ('0-1', '0,2') or module names; default all")
    provider_variant: str | None = Field(None, description="Run provider_nodes' reference ops under this provider")
    provider_nodes: list[str] = Field(default_factory=list, description="Node groups/nodes for provider_variant")
    conditioning: bool = Field(True, description="Attention conditioning of the FP32 reference, per block")


class DiagnoseResult(BaseModel):
    run_id: str
    reference_id: str
    report_url: str
    baseline: dict[str, Any]
    configurations: list[dict[str, Any]] = Field(default_factory=list)
    localisation: dict[str, Any] | None = None
    isolation: list[dict[str, Any]] = Field(default_factory=list)
    conditioning: list[dict[str, Any]] = Field(default_factory=list)


@flow(name="h3-diagnose", log_prints=True)
def diagnose_flow(params: DiagnoseParams | None = None) -> DiagnoseResult:
    """Localise the candidate's error: replace nodes by the reference, bisect, isolate, measure conditioning."""
    params = params or DiagnoseParams()
    store, preset, overrides, device = params.store, params.preset, params.overrides, params.device

    # 1. Evidence: reference, rule and checkpoint verified before any model runs
    reference = steps.resolve_reference(store, preset, device, params.reference_id)
    rule = steps.load_rule(store, reference)
    checkpoint = steps.prepare_checkpoint(store, preset, overrides, params.checkpoint)
    steps.verify_evidence(store, reference, rule, checkpoint, preset, overrides)

    # 2. Kernels compiled / warmed, as the gate does
    gpu = steps.gpu_tags(device)
    steps.prepare_extension.with_options(tags=gpu)(device)

    # 3. Diagnose runs, diagnose.json, report and artifacts
    options = {"replace": params.replace, "blocks": params.blocks, "provider_variant": params.provider_variant,
               "provider_nodes": params.provider_nodes, "auto": params.auto, "conditioning": params.conditioning}
    doc = steps.diagnose.with_options(tags=gpu)(store, reference, rule, preset, overrides, checkpoint, device,
                                                options)
    print(f"diagnose {doc['run_id']}: report {doc['report_url']}")
    return DiagnoseResult(**{k: doc[k] for k in DiagnoseResult.model_fields if k in doc})
