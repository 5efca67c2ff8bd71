"""Prefect tasks: each a thin wrapper that gives one plain function a name, tags, retries and progress.

Everything numerical lives in the plain modules (``model``, ``capture``, ``reference``, ``compare``,
``rules``, ``store``), which never import Prefect; tests call those directly. Tasks exchange store
URLs, hashes and small records, never tensors or modules. Storage credentials never travel as
parameters: every task opens the store with ``Store.from_env(url)``, which reads options from
``H3GATE_STORAGE_OPTIONS`` and credentials from the standard environment.

Retries: only store-bound steps retry (transient I/O), never a numerical step.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from tasks import calibration as calibration_lib
from tasks import model as model_lib
from tasks import progress as progress_lib
from tasks import reference as reference_lib
from tasks.calibration import ReportSet
from tasks.capture import RunInfo
from tasks.providers import device_type_of, resolve_provider
from tasks.store import Store, StoreUnreachable


def _retry_on_unreachable_store(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only when the failure was the store being unreachable (transient), never on numbers."""
    try:
        state.result()
    except StoreUnreachable:
        return True
    except Exception:  # noqa: BLE001 - any other failure is not transient
        return False
    return False


# The store itself retries a few times with backoff; these task-level retries ride out a longer outage.
STORE_RETRIES: dict[str, Any] = dict(
    retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_retry_on_unreachable_store
)


def gpu_tags(device: str) -> list[str]:
    """GPU work carries the `gpu` tag so a per-pool concurrency limit applies to it."""
    return ["gpu"] if device.startswith("cuda") else ["cpu"]


@task(name="prepare-checkpoint", **STORE_RETRIES)
def prepare_checkpoint(
    store_url: str | None, preset_name: str, overrides: dict[str, Any], checkpoint: str | None
) -> model_lib.CheckpointRef:
    """Write the synthetic checkpoint (or hash the real one) and return its reference."""
    store = Store.from_env(store_url)
    preset = model_lib.get_preset(preset_name, overrides)
    if checkpoint:
        return model_lib.open_real_checkpoint(store, checkpoint, preset)
    return model_lib.write_synthetic_checkpoint(store, preset)


@task(name="prepare-sample", **STORE_RETRIES)
def prepare_sample(store_url: str | None, preset_name: str, overrides: dict[str, Any]) -> str:
    """Build the packed FL2VA sample with diffusers' layout code and store it; return its hash."""
    preset = model_lib.get_preset(preset_name, overrides)
    return model_lib.write_sample(Store.from_env(store_url), model_lib.build_sample(preset.config, preset.sample))


@task(name="capture-run", task_run_name="capture-{provider_name}-{dtype}")
def capture_run(
    store_url: str | None,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    sample_sha: str,
    provider_name: str,
    dtype: str,
    device: str,
    granularity: str = "blocks",
    force: bool = False,
) -> RunInfo:
    """One reference run (forward + backward, every tensor streamed to the store)."""
    logger = get_run_logger()
    preset = model_lib.get_preset(preset_name, overrides)
    provider = resolve_provider(provider_name, device)
    progress = _Progress(f"capture {provider_name} {dtype}")
    info = reference_lib.capture_reference_run(
        Store.from_env(store_url), preset, checkpoint, sample_sha, provider, dtype, device,
        granularity=granularity, force=force, progress=progress,  # type: ignore[arg-type]
    )
    progress.finish()
    logger.info(
        "%s: %d tensors, %.1f MB stored, %.1f MB new%s in %.1f s",
        info.run_id, info.tensors, info.stored_bytes / 1e6, info.new_bytes / 1e6,
        " (reused)" if info.reused else "", info.wall_s,
    )
    return info


@task(name="write-reference", **STORE_RETRIES)
def write_reference(
    store_url: str | None,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    sample_sha: str,
    device: str,
    granularity: str,
    fp32_run: RunInfo,
    provider_runs: dict[str, RunInfo],
    default_provider: str,
    fp32_alt_run: RunInfo | None = None,
) -> reference_lib.ReferenceInfo:
    """Write the reference-manifest.json inventory naming every run of this reference."""
    preset = model_lib.get_preset(preset_name, overrides)
    doc = reference_lib.inventory(
        preset, checkpoint, sample_sha, device, granularity, fp32_run, provider_runs,  # type: ignore[arg-type]
        default_provider, fp32_alt_run,
    )
    return reference_lib.write_inventory(Store.from_env(store_url), preset, doc)


class _Progress:
    """A Prefect progress artifact updated as tensors stream (at most about every 5 %)."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.artifact_id: Any = None
        self.last = -1.0

    def __call__(self, done: int, total: int) -> None:
        progress_lib.report(self.description, done, total)
        percent = min(100.0, 100.0 * done / max(total, 1))
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(progress=percent, description=self.description)
        elif percent - self.last >= 5.0:
            update_progress_artifact(self.artifact_id, progress=percent)
        else:
            return
        self.last = percent

    def finish(self) -> None:
        if self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, progress=100.0)


@task(name="resolve-reference", **STORE_RETRIES)
def resolve_reference(
    store_url: str | None, preset_name: str, device: str, reference_id: str | None
) -> reference_lib.ReferenceInfo:
    """The reference to work on: the one named, or the current one of the preset on this device type."""
    store = Store.from_env(store_url)
    if reference_id:
        return reference_lib.load_reference(store, reference_id)
    return reference_lib.current_reference(store, preset_name, device_type_of(device))


@task(name="provider-reports", **STORE_RETRIES)
def provider_reports(store_url: str | None, reference: reference_lib.ReferenceInfo, device: str) -> ReportSet:
    """Every BF16 provider against FP32, tensor by tensor: report-<provider>.json (and the FP32 noise)."""
    return calibration_lib.provider_reports(Store.from_env(store_url), reference, device=device)


@task(name="write-spread", **STORE_RETRIES)
def write_spread(store_url: str | None, reference: reference_lib.ReferenceInfo, reports: ReportSet) -> dict:
    """spread.json: per tensor min/max/ratio of provider errors and the outlier."""
    return calibration_lib.write_spread(Store.from_env(store_url), reference, reports)


@task(name="calibrate-rule", **STORE_RETRIES)
def calibrate_rule(
    store_url: str | None, reference: reference_lib.ReferenceInfo, reports: ReportSet
) -> calibration_lib.RuleFiles:
    """Leave-one-out calibration of k; writes thresholds.json and ensemble-rule.json."""
    return calibration_lib.write_rule(Store.from_env(store_url), reference, reports)
