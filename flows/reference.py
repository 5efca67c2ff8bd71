"""The reference flow: an FP32 run plus one BF16 run per provider, and the inventory naming them."""

from __future__ import annotations

from typing import Any

import torch
from prefect import flow
from prefect.task_runners import ProcessPoolTaskRunner
from pydantic import Field

from flows.common import StoreParams
from tasks import steps
from tasks.providers import DEFAULT_PROVIDER, device_type_of, resolve_providers
from tasks.reference import ReferenceInfo


def assign_devices(providers: list[str], device: str, visible: int) -> dict[str, str]:
    """The device of each provider run: round-robin over cuda:0..N-1 when the reference is made on `cuda` with N > 1
    GPUs visible (one run per GPU at a time); otherwise every run on `device`, in sequence."""
    if device != "cuda" or visible < 2:
        return {name: device for name in providers}
    return {name: f"cuda:{i % visible}" for i, name in enumerate(providers)}


def _provider_runs(capture: Any, run: dict[str, Any], devices: dict[str, str]) -> dict[str, Any]:
    """BF16 provider runs: in sequence on one device; else one lane per GPU, lanes concurrent, runs in a lane chained.

    Concurrent runs are submitted to the flow's process pool: providers set process-global torch and diffusers
    switches (attention backend, oneDNN, TF32, BLAS), so two of them must never share a process.
    """
    if len(set(devices.values())) < 2:
        return {name: capture(**run, device=dev, provider_name=name, dtype="bfloat16") for name, dev in devices.items()}
    futures: dict[str, Any] = {}
    last: dict[str, Any] = {}
    for name, dev in devices.items():
        futures[name] = capture.submit(**run, device=dev, provider_name=name, dtype="bfloat16",
                                       wait_for=[last[dev]] if dev in last else None)
        last[dev] = futures[name]
    return {name: future.result() for name, future in futures.items()}


class ReferenceParams(StoreParams):
    providers: list[str] = Field(
        default_factory=list, description="BF16 providers to run (empty: the device's whole set)"
    )
    force: bool = Field(False, description="Re-capture runs the store already holds")


@flow(name="h3-reference", log_prints=True, task_runner=ProcessPoolTaskRunner())
def reference_flow(params: ReferenceParams | None = None) -> ReferenceInfo:
    """Produce (or reuse) a frozen, hashed reference of the diffusers model on this device."""
    params = params or ReferenceParams()
    providers = [p.name for p in resolve_providers(params.providers, params.device)]
    common = dict(store_url=params.store, preset_name=params.preset, overrides=params.overrides)

    # Inputs: the checkpoint and the packed sample, both hashed into the store
    checkpoint = steps.prepare_checkpoint(**common, checkpoint=params.checkpoint)
    sample_sha = steps.prepare_sample(**common)

    # Runs: FP32 first, its rounding-noise twin, then every BF16 provider
    # (GPU runs carry the `gpu` tag; with several GPUs visible the provider runs fan out, one GPU each)
    capture = steps.capture_run.with_options(tags=steps.gpu_tags(params.device))
    run = dict(common, checkpoint=checkpoint, sample_sha=sample_sha, granularity=params.capture, force=params.force)
    fp32 = capture(**run, device=params.device, provider_name="fp32", dtype="float32")
    fp32_alt = capture(**run, device=params.device, provider_name="fp32-alt", dtype="float32")
    visible = torch.cuda.device_count() if params.device == "cuda" else 0
    provider_runs = _provider_runs(capture, run, assign_devices(providers, params.device, visible))

    # Inventory: reference-manifest.json
    default = DEFAULT_PROVIDER[device_type_of(params.device)]
    return steps.write_reference(
        **common, checkpoint=checkpoint, sample_sha=sample_sha, device=params.device, granularity=params.capture,
        fp32_run=fp32, provider_runs=provider_runs, default_provider=default if default in providers else providers[0],
        fp32_alt_run=fp32_alt,
    )
