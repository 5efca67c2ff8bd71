"""The reference path end to end: flows under a real Prefect API, the CLI, S3, crashes and secrets."""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.calibrate import CalibrateParams, calibrate_flow
from flows.cli import app
from flows.reference import ReferenceParams, reference_flow
from tasks.providers import CPU_PROVIDERS, provider_set
from tasks.reference import capture_reference_run
from tasks.store import Store, StoreUnreachable
from tests.host import quick_cpu_providers

REPO = Path(__file__).resolve().parent.parent
SECRET = "SUPERSECRET-h3gate-planted-0123456789"


def test_reference_spread_calibrate_end_to_end(prefect_api, tmp_path):
    url = str(tmp_path / "store")
    info = reference_flow(ReferenceParams(store=url))
    store = Store(url)
    assert set(info.provider_runs) == set(provider_set("cpu"))
    assert info.fp32_alt_run is not None
    doc = store.read_document(info.reference_id, "reference-manifest.json")
    assert doc["fp32"]["run"] == info.fp32_run and doc["default_provider"] == "cpu-default"
    for run in [info.fp32_run, *info.provider_runs.values()]:
        assert store.verify_run(run).ok

    # a second reference with the same inputs writes no new blob and reuses every run
    blobs = sorted((tmp_path / "store" / "blobs").rglob("*"))
    again = reference_flow(ReferenceParams(store=url))
    assert again == info
    assert sorted((tmp_path / "store" / "blobs").rglob("*")) == blobs

    result = calibrate_flow(CalibrateParams(store=url))
    rule = result["rule"].rule
    assert rule.k >= 1.0 and set(rule.providers) == set(provider_set("cpu"))
    assert set(rule.leave_one_out) == set(provider_set("cpu"))
    assert rule.floor_method.startswith("fp32-noise")
    assert rule.reference_manifest_sha == store.manifest_sha(info.fp32_run)
    thresholds = store.read_document(info.reference_id, "thresholds.json")
    assert set(thresholds["reports"]) == set(provider_set("cpu"))
    assert all(not name.startswith("in/") for name in thresholds["bounds"])


def test_cli_reference_calibrate_verify_diff(prefect_api, tmp_path):
    runner = CliRunner()
    url = str(tmp_path / "store")
    result = runner.invoke(app, ["reference", "--store", url, "--providers", ",".join(quick_cpu_providers())])
    assert result.exit_code == 0, result.output
    assert "reference tiny-cpu-" in result.output
    result = runner.invoke(app, ["calibrate", "--store", url])
    assert result.exit_code == 0, result.output
    assert "k = " in result.output and "held-out worst ratios" in result.output
    assert result.output.count(" on ") >= 3 and "widest provider spread" in result.output

    store = Store(url)
    runs = store.list_runs()
    fp32 = next(r for r in runs if "-fp32-float32-" in r)
    math = next(r for r in runs if "-cpu-math-" in r)
    result = runner.invoke(app, ["diff", fp32, fp32, "--store", url])
    assert result.exit_code == 0 and "0 differing" in result.output
    result = runner.invoke(app, ["diff", fp32, math, "--store", url])
    assert result.exit_code == 0 and "rel_l2" in result.output
    assert "only in A: in/transformer_blocks.0/temb" in result.output

    result = runner.invoke(app, ["verify", "--store", url])
    assert result.exit_code == 0, result.output
    # tamper with one blob: verify names it and exits 2
    record = store.read_manifest(math)["tensors"]["grad/transformer_blocks.1.attn.to_q.weight"]
    blob = Path(url) / "blobs" / "sha256" / record["sha256"][:2] / record["sha256"]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", "--store", url, "--run", math])
    assert result.exit_code == 2
    assert "grad/transformer_blocks.1.attn.to_q.weight" in result.output and record["sha256"] in result.output


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["reference", "--store", str(tmp_path), "--preset", "huge"])
    assert result.exit_code == 2 and "unknown preset 'huge'" in result.output
    result = runner.invoke(app, ["reference", "--store", str(tmp_path), "--set", "latent_height=7"])
    assert result.exit_code == 2 and "does not patchify" in result.output
    result = runner.invoke(app, ["reference", "--store", str(tmp_path), "--providers", "flash"])
    assert result.exit_code == 2 and "unknown provider(s) flash" in result.output
    result = runner.invoke(app, ["verify", "--store", str(tmp_path), "--storage-options", "{nope"])
    assert result.exit_code == 2 and "--storage-options is not valid JSON" in result.output
    result = runner.invoke(app, ["verify", "--store", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "holds no runs" in result.output


_KILLABLE = """
import sys, time
from tasks import model as m
from tasks.providers import CPU_PROVIDERS
from tasks.reference import capture_reference_run
from tasks.store import Store
store = Store(sys.argv[1])
preset = m.get_preset("tiny")
ckpt = m.write_synthetic_checkpoint(store, preset)
sha = m.write_sample(store, m.build_sample(preset.config, preset.sample))
def slow(done, total):
    print(done, flush=True)
    time.sleep(0.05)
capture_reference_run(store, preset, ckpt, sha, CPU_PROVIDERS["cpu-math"], "bfloat16", "cpu", progress=slow)
print("finished", flush=True)
"""


def test_killed_run_leaves_no_manifest_and_resumes(tmp_path, tiny, tiny_sample):
    url = str(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, url], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip().isdigit() and int(line) >= 30:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    store = Store(url)
    assert store.list_runs() == []  # 30 blobs written, no manifest claims them
    assert len([p for p in (Path(url) / "blobs").rglob("*") if p.is_file()]) > 30
    from tasks import model as m

    ckpt = m.write_synthetic_checkpoint(store, tiny)
    sha = m.write_sample(store, tiny_sample)
    info = capture_reference_run(store, tiny, ckpt, sha, CPU_PROVIDERS["cpu-math"], "bfloat16", "cpu")
    assert store.counters["blobs_skipped"] >= 30  # resumed: the blobs of the killed run were kept
    assert store.verify_run(info.run_id).ok


@pytest.mark.service
def test_s3_store_outage_and_secret(s3_server, tiny, tiny_sample, caplog, capfd):
    caplog.set_level(logging.DEBUG, logger="tasks")
    options = s3_server.options(secret=SECRET)
    store = Store(f"s3://{s3_server.bucket}/outage", options, backoff_s=0.1)
    from tasks import model as m

    ckpt = m.write_synthetic_checkpoint(store, tiny)
    sha = m.write_sample(store, tiny_sample)
    provider = CPU_PROVIDERS["cpu-default"]

    def stop_mid_run(done: int, total: int) -> None:
        if done == 20:
            s3_server.stop()

    started = time.monotonic()
    with pytest.raises(StoreUnreachable) as failure:
        capture_reference_run(store, tiny, ckpt, sha, provider, "bfloat16", "cpu", progress=stop_mid_run)
    assert time.monotonic() - started < 30, "bounded retries, not minutes"
    message = str(failure.value)
    s3_server.start()
    assert SECRET not in message and "s3://" in message
    assert store.list_runs() == []  # nothing half-written
    info = capture_reference_run(store, tiny, ckpt, sha, provider, "bfloat16", "cpu")
    assert store.verify_run(info.run_id).ok
    manifest_text = json.dumps(store.read_manifest(info.run_id))
    out, err = capfd.readouterr()
    for text in (manifest_text, caplog.text, out, err, repr(store), store.url):
        assert SECRET not in text


@pytest.mark.service
def test_reference_flow_on_s3_never_shows_the_secret(prefect_api, s3_server, monkeypatch, capfd):
    monkeypatch.setenv("H3GATE_STORAGE_OPTIONS", json.dumps(s3_server.options(secret=SECRET)))
    url = f"s3://{s3_server.bucket}/flow"
    info = reference_flow(ReferenceParams(store=url, providers=quick_cpu_providers()))
    calibrate_flow(CalibrateParams(store=url))
    store = Store.from_env(url)
    texts = [json.dumps(store.read_manifest(r)) for r in store.list_runs()]
    texts.append(json.dumps(store.read_document(info.reference_id, "ensemble-rule.json")))
    texts += list(capfd.readouterr())
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        texts += [json.dumps(a.model_dump(mode="json")) for a in client.read_artifacts()]
        texts += [json.dumps(r.model_dump(mode="json")) for r in client.read_flow_runs()]
        texts += [json.dumps(r.model_dump(mode="json")) for r in client.read_task_runs()]
        texts += [log.message for log in client.read_logs()]
    assert texts and all(SECRET not in text for text in texts)


class _CountingStore(Store):
    """The same store, counting tensor reads per blob (instrumentation, not a fake: every read is real)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()

    def get_tensor(self, sha256, *, name=None, device="cpu"):
        self.reads[name, sha256] += 1
        return super().get_tensor(sha256, name=name, device=device)


def test_provider_reports_read_the_fp32_run_once_and_reuse_stored_reports(calibrated_tiny):
    from tasks import calibration

    store, _, _, reference, _ = calibrated_tiny
    before = calibration.provider_reports(store, reference)
    counting = _CountingStore(store.url)
    assert calibration.provider_reports(counting, reference) == before and not counting.reads  # all reused

    # two missing reports are recomputed together: one sweep, each FP32 tensor read once, the same numbers
    root = Path(store.root) / "runs" / reference.reference_id
    (root / "report-cpu-math.json").unlink()
    (root / "fp32-noise.json").unlink()
    again = calibration.provider_reports(counting, reference)
    assert again == before
    expected: collections.Counter[tuple[str, str]] = collections.Counter()
    for run in (reference.fp32_run, reference.provider_runs["cpu-math"], reference.fp32_alt_run):
        expected.update((f"{run}/{n}", r["sha256"]) for n, r in store.read_manifest(run)["tensors"].items()
                        if not n.startswith("in/"))
    assert counting.reads == expected


def test_compare_stored_runs_is_the_same_run_by_run_or_together(calibrated_tiny):
    from tasks.calibration import compare_stored_runs

    store, _, _, reference, _ = calibrated_tiny
    runs = sorted(reference.provider_runs.values())
    together = compare_stored_runs(store, runs, reference.fp32_run)
    for run in runs:
        assert together[run] == compare_stored_runs(store, [run], reference.fp32_run)[run]
