"""The calibrate flow: provider reports -> spread -> single-provider bounds and the ensemble rule."""

from __future__ import annotations

from prefect import flow

from flows.spread import SpreadParams
from tasks import steps


class CalibrateParams(SpreadParams):
    """Which reference to calibrate the ensemble rule on."""


@flow(name="h3-calibrate", log_prints=True)
def calibrate_flow(params: CalibrateParams | None = None) -> dict:
    """Calibrate k by leave-one-out over the providers of a stored reference (provider data only)."""
    params = params or CalibrateParams()
    # Provider data: every BF16 provider and the FP32 noise run against the FP32 reference
    # (small results persisted and reused by a rerun with identical inputs and code: steps.cached)
    reference = steps.resolve_reference(params.store, params.preset, params.device, params.reference_id)
    reports = steps.cached(steps.provider_reports, params.store).with_options(tags=steps.gpu_tags(params.device))(
        params.store, reference, params.device)
    spread = steps.cached(steps.write_spread, params.store)(params.store, reference, reports)

    # Rule: thresholds.json (record) and ensemble-rule.json (the gate)
    rule = steps.cached(steps.calibrate_rule, params.store)(params.store, reference, reports)
    return {"reference": reference, "reports": reports, "spread": spread, "rule": rule}
