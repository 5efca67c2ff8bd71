"""The spread flow: every BF16 provider against FP32, per tensor, and how far they disagree."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, Field

from tasks import steps


class SpreadParams(BaseModel):
    store: str | None = Field(None, description="Store URL; default $H3GATE_STORE or ./h3store")
    preset: str = Field("tiny", description="Preset whose current reference to use")
    device: str = Field("cpu", description="Device type the reference was made on (cpu, cuda)")
    reference_id: str | None = Field(None, description="A specific reference id (default: the preset's current)")


@flow(name="h3-spread", log_prints=True)
def spread_flow(params: SpreadParams | None = None) -> dict:
    """Provider reports and spread.json for a stored reference."""
    params = params or SpreadParams()
    reference = steps.resolve_reference(params.store, params.preset, params.device, params.reference_id)
    reports = steps.provider_reports(params.store, reference, params.device)
    return {"reference": reference, "reports": reports,
            "spread": steps.write_spread(params.store, reference, reports)}
