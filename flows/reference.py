"""The reference flow: an FP32 run plus one BF16 run per provider, and the inventory naming them."""

from __future__ import annotations

from prefect import flow
from pydantic import Field

from flows.common import StoreParams
from tasks import steps
from tasks.providers import DEFAULT_PROVIDER, device_type_of, resolve_providers
from tasks.reference import ReferenceInfo


class ReferenceParams(StoreParams):
    providers: list[str] = Field(
        default_factory=list, description="BF16 providers to run (empty: the device's whole set)"
    )
    force: bool = Field(False, description="Re-capture runs the store already holds")


@flow(name="h3-reference", log_prints=True)
def reference_flow(params: ReferenceParams | None = None) -> ReferenceInfo:
    """Produce (or reuse) a frozen, hashed reference of the diffusers model on this device."""
    params = params or ReferenceParams()
    providers = [p.name for p in resolve_providers(params.providers, params.device)]
    common = dict(store_url=params.store, preset_name=params.preset, overrides=params.overrides)

    # Inputs: the checkpoint and the packed sample, both hashed into the store
    checkpoint = steps.prepare_checkpoint(**common, checkpoint=params.checkpoint)
    sample_sha = steps.prepare_sample(**common)

    # Runs: FP32 first, its rounding-noise twin, then every BF16 provider
    run = dict(common, checkpoint=checkpoint, sample_sha=sample_sha, device=params.device,
               granularity=params.capture, force=params.force)
    fp32 = steps.capture_run(**run, provider_name="fp32", dtype="float32")
    fp32_alt = steps.capture_run(**run, provider_name="fp32-alt", dtype="float32")
    provider_runs = {name: steps.capture_run(**run, provider_name=name, dtype="bfloat16") for name in providers}

    # Inventory: reference-manifest.json
    default = DEFAULT_PROVIDER[device_type_of(params.device)]
    return steps.write_reference(
        **common, checkpoint=checkpoint, sample_sha=sample_sha, device=params.device, granularity=params.capture,
        fp32_run=fp32, provider_runs=provider_runs, default_provider=default if default in providers else providers[0],
        fp32_alt_run=fp32_alt,
    )
