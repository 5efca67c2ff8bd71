"""The reference: one FP32 run and one BF16 run per provider, named by an inventory.

``capture_reference_run`` makes (or reuses) one run; ``write_inventory`` writes the
``reference-manifest.json`` inventory that names them all, as a content-addressed blob, as
``runs/<reference_id>/reference-manifest.json`` and as the pointer
``refs/current/<preset>-<device type>.json``; ``find_reference`` answers "does the store already
hold a reference for this preset, checkpoint, sample and provider set?" so flows can reuse it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tasks.capture import DTYPES, Granularity, RunInfo, RunSpec, record_run, stored_run
from tasks.memory_plan import plan_memory
from tasks.model import CheckpointRef, Preset, load_model, read_sample
from tasks.placement import Placement
from tasks.provider_process import run_in_own_process, store_request
from tasks.providers import Provider, device_type_of, fp32_provider, needs_own_process
from tasks.store import Store

INVENTORY_FILE = "reference-manifest.json"


class ReferenceNotFound(LookupError):
    """No reference in the store matches what was asked for; the message says how to make one."""


@dataclass(frozen=True)
class ReferenceInfo:
    """A small record naming a stored reference (what flows exchange)."""

    reference_id: str
    inventory_sha: str
    preset: str
    device_type: str
    checkpoint_sha: str
    sample_sha: str
    fp32_run: str
    provider_runs: Mapping[str, str]  # provider name -> run id
    default_provider: str
    fp32_alt_run: str | None = None  # the FP32 noise run (floor of the rule)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "provider_runs": dict(self.provider_runs)}


def run_spec(
    preset: Preset,
    checkpoint: CheckpointRef,
    sample_sha: str,
    provider: Provider,
    dtype: str,
    device: str | torch.device,
    granularity: Granularity = "blocks",
    candidate: Mapping[str, Any] | None = None,
) -> RunSpec:
    """The identity of one run. FP32 reference runs also capture the golden block's inputs."""
    return RunSpec(
        preset=preset.name,
        config=preset.config,
        checkpoint_sha=checkpoint.sha256,
        sample_sha=sample_sha,
        provider=provider.to_json(),
        dtype=dtype,
        device_type=device_type_of(device),
        granularity=granularity,
        golden_inputs=dtype == "float32" and candidate is None,
        candidate=candidate,
    )


def capture_reference_run(
    store: Store,
    preset: Preset,
    checkpoint: CheckpointRef,
    sample_sha: str,
    provider: Provider,
    dtype: str,
    device: str | torch.device,
    *,
    granularity: Granularity = "blocks",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    placement: Placement | None = None,
) -> RunInfo:
    """Make (or reuse) one reference run: load the model in ``dtype``, run it under ``provider``.

    ``placement`` splits the model over devices (its first device is then ``device``); before anything
    is loaded the memory plan of that placement is checked, and a run that cannot fit is refused with
    ``PlanDoesNotFit``. Placement and plan are recorded in the run's metadata: they do not change what
    the run computes, so they are not part of its identity. A provider this process cannot run (other ATen
    kernels) makes its run in a process of its own (tasks/provider_process.py), without ``progress``.
    """
    placement = placement or Placement.single(str(device), preset.config["num_layers"])
    device = placement.main_device
    spec = run_spec(preset, checkpoint, sample_sha, provider, dtype, device, granularity)
    if not force and (stored := stored_run(store, spec.run_id)) is not None:
        return stored
    if needs_own_process(provider):
        request = {"store": store_request(store), "preset": preset.to_json(), "checkpoint": asdict(checkpoint),
                   "sample_sha": sample_sha, "dtype": dtype, "device": str(device), "granularity": granularity,
                   "force": force}
        return RunInfo(**run_in_own_process(provider, "capture", request))
    plan = plan_memory(preset, dtype, placement, provider=provider, granularity=granularity)
    plan.require_fit()
    sample = read_sample(store, sample_sha, preset.config)
    model = load_model(store, checkpoint, DTYPES[dtype], device, placement)
    try:
        return record_run(store, spec, model, sample, provider, device=device, progress=progress, overwrite=force,
                          metadata={"placement": placement.to_json(), "memory_plan": plan.to_json()},
                          model_devices=placement.devices)
    finally:
        del model
        for dev in {torch.device(d) for d in placement.devices}:
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def inventory(
    preset: Preset,
    checkpoint: CheckpointRef,
    sample_sha: str,
    device: str | torch.device,
    granularity: Granularity,
    fp32_run: RunInfo,
    provider_runs: Mapping[str, RunInfo],
    default_provider: str,
    fp32_alt_run: RunInfo | None = None,
) -> dict[str, Any]:
    """The reference-manifest.json content: deterministic, no time, host or path."""
    return {
        "preset": preset.to_json(),
        "checkpoint": checkpoint.sha256,
        "sample": sample_sha,
        "device_type": device_type_of(device),
        "granularity": granularity,
        "fp32": {"provider": fp32_provider(device).name, "run": fp32_run.run_id, "manifest": fp32_run.manifest_sha},
        "fp32_alt": None if fp32_alt_run is None else {"run": fp32_alt_run.run_id,
                                                       "manifest": fp32_alt_run.manifest_sha},
        "providers": {
            name: {"run": info.run_id, "manifest": info.manifest_sha} for name, info in sorted(provider_runs.items())
        },
        "default_provider": default_provider,
    }


def reference_id_for(preset: Preset, inventory_doc: Mapping[str, Any]) -> str:
    key = {k: inventory_doc[k] for k in ("preset", "checkpoint", "sample", "device_type", "granularity")}
    key["providers"] = sorted(inventory_doc["providers"])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return f"{preset.name}-{inventory_doc['device_type']}-{digest[:12]}"


def write_inventory(store: Store, preset: Preset, inventory_doc: Mapping[str, Any]) -> ReferenceInfo:
    """Store the inventory and point ``refs/current/<preset>-<device type>`` at it."""
    reference_id = reference_id_for(preset, inventory_doc)
    blob = store.write_document(reference_id, INVENTORY_FILE, dict(inventory_doc))
    info = _info(reference_id, blob.sha256, inventory_doc)
    store.write_ref("references", reference_id, info.to_json())
    store.write_ref("current", f"{preset.name}-{inventory_doc['device_type']}", info.to_json())
    return info


def _info(reference_id: str, sha: str, doc: Mapping[str, Any]) -> ReferenceInfo:
    return ReferenceInfo(
        reference_id=reference_id,
        inventory_sha=sha,
        preset=doc["preset"]["name"],
        device_type=doc["device_type"],
        checkpoint_sha=doc["checkpoint"],
        sample_sha=doc["sample"],
        fp32_run=doc["fp32"]["run"],
        provider_runs={name: entry["run"] for name, entry in doc["providers"].items()},
        default_provider=doc["default_provider"],
        fp32_alt_run=(doc.get("fp32_alt") or {}).get("run"),
    )


def load_reference(store: Store, reference_id: str) -> ReferenceInfo:
    """Read a reference by id, verifying its inventory blob."""
    pointer = store.read_ref("references", reference_id)
    if pointer is None:
        raise ReferenceNotFound(f"no reference {reference_id!r} in the store; run `h3gate reference` first")
    doc = store.get_json(pointer["inventory_sha"], name=f"{reference_id}/{INVENTORY_FILE}")
    return _info(reference_id, pointer["inventory_sha"], doc)


def current_reference(store: Store, preset: str, device_type: str) -> ReferenceInfo:
    """The reference most recently made for ``preset`` on ``device_type``."""
    pointer = store.read_ref("current", f"{preset}-{device_type}")
    if pointer is None:
        raise ReferenceNotFound(
            f"the store holds no reference for preset {preset!r} on {device_type}; "
            f"run `h3gate reference --preset {preset} --device {device_type}` first"
        )
    return load_reference(store, pointer["reference_id"])


def find_reference(
    store: Store,
    preset: Preset,
    checkpoint: CheckpointRef,
    sample_sha: str,
    device: str | torch.device,
    granularity: Granularity,
    providers: Sequence[Provider],
) -> ReferenceInfo | None:
    """The stored reference with exactly this identity, if every one of its runs is present."""
    key_doc = {
        "preset": preset.to_json(),
        "checkpoint": checkpoint.sha256,
        "sample": sample_sha,
        "device_type": device_type_of(device),
        "granularity": granularity,
        "providers": {p.name: None for p in providers},
    }
    reference_id = reference_id_for(preset, key_doc)
    if store.read_ref("references", reference_id) is None:
        return None
    info = load_reference(store, reference_id)
    runs = [info.fp32_run, *info.provider_runs.values(), *([info.fp32_alt_run] if info.fp32_alt_run else [])]
    return info if all(store.has_manifest(run) for run in runs) else None
