"""qualify: reference (reused when the store holds it) -> calibrate -> gate, in one flow."""

from __future__ import annotations

from prefect import flow

from flows.calibrate import CalibrateParams, calibrate_flow
from flows.gate import GateParams, GateResult, gate_flow
from flows.reference import ReferenceParams, reference_flow


class QualifyParams(GateParams, ReferenceParams):
    """Everything a qualification needs: the reference's inputs and the gate's options."""


@flow(name="h3-qualify", log_prints=True)
def qualify_flow(params: QualifyParams | None = None) -> GateResult:
    """Make or reuse the reference, calibrate the rule on its providers, gate the candidate."""
    params = params or QualifyParams()
    fields = params.model_dump()

    # Reference: every run is reused when the store already holds it
    reference = reference_flow(ReferenceParams(**{k: fields[k] for k in ReferenceParams.model_fields}))

    # Rule: leave-one-out calibration on the providers
    calibrate_flow(CalibrateParams(store=params.store, preset=params.preset, device=params.device,
                                   reference_id=reference.reference_id))

    # Gate: the candidate against exactly that reference and rule
    gate = {k: fields[k] for k in GateParams.model_fields} | {"reference_id": reference.reference_id}
    return gate_flow(GateParams(**gate))
