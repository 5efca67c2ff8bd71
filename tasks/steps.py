"""Prefect tasks: each a thin wrapper that gives one plain function a name, tags, retries and progress.

Everything numerical lives in the plain modules (``model``, ``capture``, ``reference``, ``compare``,
``rules``, ``store``), which never import Prefect; tests call those directly. Tasks exchange store
URLs, hashes and small records, never tensors or modules. Storage credentials never travel as
parameters: every task opens the store with ``Store.from_env(url)``, which reads options from
``H3GATE_STORAGE_OPTIONS`` and credentials from the standard environment.

Retries: only store-bound steps retry (transient I/O), never a numerical step.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.logging import get_run_logger

from tasks import calibration as calibration_lib
from tasks import gate as gate_lib
from tasks import model as model_lib
from tasks import progress as progress_lib
from tasks import reference as reference_lib
from tasks.calibration import ReportSet
from tasks.capture import RunInfo
from tasks.placement import Placement, PlacementError
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
    split: str = "",
) -> RunInfo:
    """One reference run (forward + backward, every tensor streamed to the store), split over devices by ``split``."""
    logger = get_run_logger()
    preset = model_lib.get_preset(preset_name, overrides)
    placement = split_placement(split, device, preset)
    provider = resolve_provider(provider_name, device)
    if placement is not None:
        logger.info("%s %s split over %s", provider_name, dtype, placement.describe())
    progress = _Progress(f"capture {provider_name} {dtype}")
    info = reference_lib.capture_reference_run(
        Store.from_env(store_url), preset, checkpoint, sample_sha, provider, dtype, device,
        granularity=granularity, force=force, progress=progress, placement=placement,  # type: ignore[arg-type]
    )
    progress.finish()
    logger.info(
        "%s: %d tensors, %.1f MB stored, %.1f MB new%s in %.1f s",
        info.run_id, info.tensors, info.stored_bytes / 1e6, info.new_bytes / 1e6,
        " (reused)" if info.reused else "", info.wall_s,
    )
    return info


def split_placement(split: str, device: str, preset: model_lib.Preset) -> Placement | None:
    """The placement a ``split`` spec names (None when empty); its first device must be of ``device``'s type."""
    if not split:
        return None
    placement = Placement.parse(split, preset.config["num_layers"])
    if device_type_of(placement.main_device) != device_type_of(device):
        raise PlacementError(f"split {split!r} starts on {placement.main_device}, but the run's device is {device}")
    return placement


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


@task(name="load-rule", **STORE_RETRIES)
def load_rule(store_url: str | None, reference: reference_lib.ReferenceInfo) -> calibration_lib.RuleFiles:
    """The calibrated ensemble rule of the reference (its hash verified)."""
    return calibration_lib.load_rule(Store.from_env(store_url), reference.reference_id)


@task(name="verify-evidence", **STORE_RETRIES)
def verify_evidence(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    rule: calibration_lib.RuleFiles,
    checkpoint: model_lib.CheckpointRef,
    preset_name: str,
    overrides: dict[str, Any],
) -> int:
    """Re-hash every reference blob, the rule and the checkpoint before any model runs."""
    store = Store.from_env(store_url)
    preset = model_lib.get_preset(preset_name, overrides)
    inventory = store.get_json(reference.inventory_sha, name=f"{reference.reference_id}/reference-manifest.json")
    if inventory["preset"] != preset.to_json():
        raise gate_lib.GateError(
            f"reference {reference.reference_id} was made for preset {inventory['preset']['name']} with config "
            f"{inventory['preset']['config']} and sample {inventory['preset']['sample']}; the gate was asked for "
            f"{preset.to_json()}: pass the same preset and overrides, or regenerate the reference"
        )
    checked = gate_lib.verify_evidence(store, reference, rule, checkpoint)
    get_run_logger().info("verified %d blobs of %s and its rule", checked, reference.reference_id)
    return checked


@task(name="prepare-extension")
def prepare_extension(device: str) -> dict[str, Any]:
    """Compile or interpret every candidate kernel once; record versions."""
    return gate_lib.prepare_extension(device)


@task(name="run-candidate")
def run_candidate(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    device: str,
    nodes: list[str] | None,
    keep_candidate: bool,
    split: str = "",
) -> gate_lib.CandidateRun:
    """The strictly bound candidate, forward + backward, every tensor compared as it is produced."""
    progress = _Progress("candidate forward+backward")
    preset = model_lib.get_preset(preset_name, overrides)
    run = gate_lib.run_candidate(
        Store.from_env(store_url), reference, preset, checkpoint, device=device, nodes=nodes or None,
        keep_candidate=keep_candidate, progress=progress, placement=split_placement(split, device, preset),
    )
    progress.finish()
    return run


@task(name="decide")
def decide(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    rule: calibration_lib.RuleFiles,
    run: gate_lib.CandidateRun,
    golden: dict[str, Any],
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The verdict; writes verdict.json and ledger.json under runs/<gate_id>/."""
    store = Store.from_env(store_url)
    gid = gate_lib.gate_id(reference, rule, run.candidate)
    verdict = gate_lib.decide(store, rule, run)
    extra = {"gate_id": gid, "reference_id": reference.reference_id, "golden_passed": golden["passed"],
             "candidate_run": {"wall_s": round(run.wall_s, 3), "peak_device_bytes": run.peak_device_bytes,
                               "reference_load_s": round(run.reference_load_s, 3),
                               "reference_preloaded_on": run.reference_preloaded_on}}
    documents = gate_lib.write_gate_documents(store, gid, verdict, run, extra)
    return gid, verdict.to_dict(), documents


@task(name="publish-report", **STORE_RETRIES)
def publish_report(
    store_url: str | None,
    gid: str,
    verdict: dict[str, Any],
    reference: reference_lib.ReferenceInfo,
    rule: calibration_lib.RuleFiles,
    identity: dict[str, Any],
    extra_sections: list[tuple[str, Any]] | None = None,
) -> str:
    """The HTML drift report into the store, and the verdict/worst-tensors/report artifacts."""
    from tasks import report as report_lib

    store = Store.from_env(store_url)
    reports = calibration_lib.provider_reports(store, reference)
    html = report_lib.build_report(verdict, reports.errors, rule.rule.to_dict(), identity,
                                   extra_sections=extra_sections or ())
    url, _ = report_lib.store_report(store, html, run_id=gid)
    report_lib.publish_artifacts(verdict, identity, url, key_prefix=f"gate-{reference.preset}-{reference.device_type}")
    return url


@task(name="golden-tests", **STORE_RETRIES)
def golden_tests(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    device: str,
) -> dict[str, Any]:
    """Block-0 golden tests: each candidate node on the exact inputs it saw in the FP32 reference."""
    from tasks import golden as golden_lib

    store = Store.from_env(store_url)
    result = golden_lib.run_golden(store, reference, model_lib.get_preset(preset_name, overrides), checkpoint,
                                   device=device)
    store.write_document(reference.reference_id, "golden-tests.json", result)
    failed = [t["name"] for t in result["tests"] if t["outcome"] == "failed"]
    get_run_logger().info("golden tests: %d run, %d failed%s", len(result["tests"]), len(failed),
                          f" ({', '.join(failed[:5])})" if failed else "")
    return result


# -- Result persistence and caching (small results only; tensors stay in the content-addressed store) --------


class LibrarySources(CachePolicy):
    """Cache-key part: the source of every plain module under tasks/ (TASK_SOURCE sees only the wrapper)."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return _library_digest()


@functools.cache
def _library_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# A rerun with identical inputs and code reuses the persisted result (the default policy includes the run id).
SMALL_RESULT_CACHE = INPUTS + TASK_SOURCE + LibrarySources()


def result_storage_for(store_url: str | None) -> Path | None:
    """Prefect result storage for a store: <root>/prefect-results for file stores, else Prefect's default."""
    store = Store.from_env(store_url)
    return Path(store.root) / "prefect-results" if store.url.startswith("file://") else None


def cached(task_: Any, store_url: str | None) -> Any:
    """``task_`` with its small result persisted and cached across flow runs (INPUTS + TASK_SOURCE + sources)."""
    storage = result_storage_for(store_url)
    return task_.with_options(cache_policy=SMALL_RESULT_CACHE, persist_result=True,
                              **({"result_storage": storage} if storage is not None else {}))


# -- self-test (gate power: tasks.selftest) -------------------------------------------------------


@task(name="selftest")
def selftest(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    rule: calibration_lib.RuleFiles,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    device: str,
    mutants: list[str] | None,
    seed: int | None,
) -> dict[str, Any]:
    """Mutants and false-reject probes through the gate; writes selftest.json and the report; returns the doc."""
    from prefect.artifacts import create_markdown_artifact

    from tasks import mutants as mutants_lib
    from tasks import report as report_lib
    from tasks import selftest as selftest_lib

    store = Store.from_env(store_url)
    preset = model_lib.get_preset(preset_name, overrides)
    chosen = mutants_lib.select(preset.config, mutants)
    logger = get_run_logger()
    result = selftest_lib.run_selftest(store, reference, rule, preset, checkpoint, device=device, mutants=chosen,
                                       seed=seed, progress=logger.info)
    run_id, sha = selftest_lib.write_selftest(store, result)
    section = selftest_lib.selftest_html(result)
    identity = {"title": f"h3gate self-test: {preset_name} on {device}", "reference": reference.reference_id,
                "rule sha256": rule.rule_sha, "selftest.json sha256": sha}
    reports = calibration_lib.provider_reports(store, reference, device=device)
    page = report_lib.build_report(result.baseline_verdict or {}, reports.errors, rule.rule.to_dict(), identity,
                                   extra_sections=[("Self-test: gate power", section)])
    url, _ = report_lib.store_report(store, page, run_id=run_id)
    summary = result.summary()
    create_markdown_artifact(
        key=f"selftest-{reference.preset}-{reference.device_type}",
        markdown=(f"## h3gate self-test: {summary['must_catch_caught']}/{summary['must_catch']} must-catch caught, "
                  f"{summary['false_rejects']} false rejects\n\n" + "".join(f"- {f}\n" for f in result.findings)
                  + f"\n[Report]({url})\n"),
    )
    return {**result.to_dict(), "run_id": run_id, "selftest_sha256": sha, "report_url": url}


# -- diagnose (replacement, localisation, isolation, conditioning: tasks.diagnose) ---------------------------


@task(name="diagnose")
def diagnose(
    store_url: str | None,
    reference: reference_lib.ReferenceInfo,
    rule: calibration_lib.RuleFiles,
    preset_name: str,
    overrides: dict[str, Any],
    checkpoint: model_lib.CheckpointRef,
    device: str,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Diagnose runs; writes diagnose.json and the report, publishes markdown + table artifacts; returns the doc."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from tasks import diagnose as diagnose_lib
    from tasks import diagnose_report
    from tasks import report as report_lib

    store = Store.from_env(store_url)
    result = diagnose_lib.run_diagnose(store, reference, rule, model_lib.get_preset(preset_name, overrides),
                                       checkpoint, device=device, **options)
    doc = result.doc
    sha = diagnose_lib.write_diagnose(store, doc)
    identity = {"title": f"h3gate diagnose: {preset_name} on {device}", "reference": reference.reference_id,
                "diagnose run": doc["run_id"], "diagnose.json sha256": sha, "rule sha256": rule.rule_sha}
    reports = calibration_lib.provider_reports(store, reference, device=device)
    page = report_lib.build_report(result.runs[0].verdict.to_dict(), reports.errors, rule.rule.to_dict(), identity,
                                   extra_sections=diagnose_report.sections(doc))
    url, _ = report_lib.store_report(store, page, run_id=doc["run_id"])
    key = f"diagnose-{reference.preset}-{reference.device_type}"
    create_markdown_artifact(key=key, markdown=diagnose_report.markdown(doc, url), description="h3gate diagnose")
    create_table_artifact(key=f"{key}-runs", table=diagnose_report.table_rows(doc),
                          description="every diagnose configuration and its verdict summary")
    return {**doc, "diagnose_sha256": sha, "report_url": url}
