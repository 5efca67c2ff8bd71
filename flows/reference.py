"""The reference flow: an FP32 run plus one BF16 run per provider, and the inventory naming them."""

from __future__ import annotations

from typing import Any

import torch
from prefect import flow
from prefect.task_runners import ProcessPoolTaskRunner
from pydantic import Field

from flows.common import StoreParams
from tasks import steps
from tasks.placement import assign_lanes, lane_target, lanes
from tasks.providers import DEFAULT_PROVIDER, device_type_of, resolve_providers
from tasks.reference import ReferenceInfo


def _capture_in_lanes(capture: Any, run: dict[str, Any], runs: dict[str, str], lane_specs: list[str]) -> dict[str, Any]:
    """Every run (provider name -> dtype), round-robin over lanes: in sequence with one lane; else lanes concurrent,
    the runs of a lane chained (a lane is one device, or the group of devices one split model occupies).

    Concurrent runs are submitted to the flow's process pool: providers set process-global torch and diffusers
    switches (attention backend, oneDNN, TF32, BLAS), so two of them must never share a process.
    """
    assigned = assign_lanes(list(runs), lane_specs)

    def args(name: str) -> dict[str, Any]:
        device, split = lane_target(assigned[name])
        return dict(run, device=device, split=split, provider_name=name, dtype=runs[name])

    if len(lane_specs) < 2:
        return {name: capture(**args(name)) for name in runs}
    futures: dict[str, Any] = {}
    last: dict[str, Any] = {}
    for name in runs:
        lane = assigned[name]
        futures[name] = capture.submit(**args(name), wait_for=[last[lane]] if lane in last else None)
        last[lane] = futures[name]
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

    # Runs: FP32, its rounding-noise twin, then every BF16 provider. GPU runs carry the `gpu` tag; with several
    # lanes (GPUs, or groups of GPUs that each hold one split model) the runs fan out over them.
    capture = steps.capture_run.with_options(tags=steps.gpu_tags(params.device))
    run = dict(common, checkpoint=checkpoint, sample_sha=sample_sha, granularity=params.capture, force=params.force)
    visible = torch.cuda.device_count() if params.device == "cuda" else 0
    lane_specs = lanes(params.device, params.split, params.gpus_per_run, visible)
    runs = _capture_in_lanes(capture, run, {"fp32": "float32", "fp32-alt": "float32",
                                            **dict.fromkeys(providers, "bfloat16")}, lane_specs)
    fp32, fp32_alt = runs.pop("fp32"), runs.pop("fp32-alt")
    provider_runs = runs

    # Inventory: reference-manifest.json
    default = DEFAULT_PROVIDER[device_type_of(params.device)]
    return steps.write_reference(
        **common, checkpoint=checkpoint, sample_sha=sample_sha, device=params.device, granularity=params.capture,
        fp32_run=fp32, provider_runs=provider_runs, default_provider=default if default in providers else providers[0],
        fp32_alt_run=fp32_alt,
    )
