"""Evidence bundles (redaction, tests.json, SHA256SUMS) and cached calibration."""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from flows.calibrate import CalibrateParams, calibrate_flow
from flows.qualify import QualifyParams, qualify_flow
from tasks.evidence import Redactor, build_bundle, verify_sums
from tasks.store import Store
from tests.host import quick_cpu_providers

HOST = "gpu-node-17.corp.example.com"
HOME = "/home/alice"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PROVIDERS = quick_cpu_providers()


@pytest.fixture(scope="module")
def gated(prefect_api, tmp_path_factory):
    """A tiny qualify (3 providers) under a real Prefect API: (store url, gate result)."""
    url = str(tmp_path_factory.mktemp("evidence") / "store")
    result = qualify_flow(QualifyParams(store=url, providers=PROVIDERS))
    assert result.passed and result.gate_id
    return url, result


def _sha256sum_check(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)


def test_bundle_redacts_and_verifies_itself(gated, tmp_path):
    url, result = gated
    store = Store(url)
    logs = {"worker": [f"17:00 INFO worker on {HOST} pulled {HOME}/h3gate/flows/gate.py",
                       f"17:01 DEBUG env AWS_ACCESS_KEY_ID={KEY_ID} AWS_SECRET_ACCESS_KEY={SECRET}",
                       f"17:02 INFO s3fs key={KEY_ID} secret {SECRET} host {HOST.split('.')[0]}",
                       "17:03 INFO wrote /var/lib/h3/runs/x/report.html; tensor grad/transformer_blocks.0.ff.weight"]}
    meta = {"host": HOST, "user": "alice", "workdir": f"{HOME}/src/h3gate", "aws_access_key_id": KEY_ID,
            "note": f"launched by alice from {HOST} with {SECRET}"}
    out = tmp_path / "bundle"
    info = build_bundle(store, result.gate_id, out, logs=logs, extra_metadata=meta,
                        flow_runs={"qualify": "http://127.0.0.1:4200/runs/flow-run/0000"},
                        redactor=Redactor.for_this_machine(homes=[HOME]))

    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"SUMMARY.md", "tests.json", "redaction.json", "SHA256SUMS", "report.html", "verdict.json",
            "ledger.json", "metadata.json", "logs/worker.log"} <= names
    assert sum(n.startswith("manifests/") for n in names) == 2 + len(PROVIDERS)

    # nothing planted, and not the real host or user, survives anywhere but the byte-for-byte report
    real_host, real_user = socket.gethostname(), getpass.getuser()
    for name in names - {"report.html"}:
        text = (out / name).read_text()
        for planted in (HOST, HOST.split(".")[0], HOME, KEY_ID, SECRET, "alice", "/var/lib/h3"):
            assert planted not in text, (name, planted)
        if name.startswith("manifests/"):
            meta_doc = json.loads(text)["metadata"]
            assert meta_doc["host"] == "<host>" and meta_doc["user"] == "<user>"
            assert f'"{real_host}"' not in text and f'"{real_user}"' not in text
    log = (out / "logs" / "worker.log").read_text()
    assert "<aws-access-key-id>" in log and "<secret>" in log and "<host>" in log and "~/h3gate/flows/gate.py" in log
    assert "grad/transformer_blocks.0.ff.weight" in log and "<path>/report.html" in log

    redaction = json.loads((out / "redaction.json").read_text())
    removed = redaction["removed"]
    assert removed["aws_access_key_id"] >= 2 and removed["secret"] >= 3 and removed["host"] >= 3 + len(PROVIDERS)
    assert removed["user"] >= 2 + len(PROVIDERS) and removed["home_path"] >= 2 and removed["absolute_path"] >= 1
    assert redaction["by_file"]["logs/worker.log"]["aws_access_key_id"] == 2
    assert KEY_ID not in json.dumps(redaction) and SECRET not in json.dumps(redaction)

    # tests.json: gate checks, golden tests (from runs/<reference>/golden-tests.json), ledger nodes
    tests = json.loads((out / "tests.json").read_text())["tests"]
    assert all({"name", "outcome", "skip_reason"} <= set(t) for t in tests)
    suites = {t["suite"] for t in tests}
    assert suites == {"gate", "golden", "ledger"}
    golden = store.read_document(result.reference_id, "golden-tests.json")["tests"]
    assert sorted(t["name"] for t in tests if t["suite"] == "golden") == sorted(t["name"] for t in golden)
    assert next(t for t in tests if t["name"] == "gate/verdict")["outcome"] == "passed"
    assert any(t["name"] == "transformer_blocks.0/attention" and t["outcome"] == "passed" for t in tests)

    # SUMMARY.md: fixed links by hash and the flow run
    summary = (out / "SUMMARY.md").read_text()
    assert "### h3gate evidence: PASS" in summary and result.gate_id in summary
    verdict_sha = store.write_document(result.gate_id, "verdict.json",
                                       store.read_document(result.gate_id, "verdict.json")).sha256
    assert f"<store>/blobs/sha256/{verdict_sha[:2]}/{verdict_sha}" in summary
    assert "http://127.0.0.1:4200/runs/flow-run/0000" in summary
    assert (out / "report.html").read_bytes() == (Path(url) / "runs" / result.gate_id / "report.html").read_bytes()

    # the bundle verifies itself; tampering with one file fails it
    assert not verify_sums(out)
    ok = _sha256sum_check(out)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    tests_file = out / "tests.json"
    tests_file.write_text(tests_file.read_text().replace('"passed"', '"failed"', 1))
    bad = _sha256sum_check(out)
    assert bad.returncode != 0 and "tests.json: FAILED" in bad.stdout
    assert verify_sums(out) == ["tests.json"]
    assert info["passed"] and info["sums_sha256"]

    with pytest.raises(FileExistsError):
        build_bundle(store, result.gate_id, out)


def test_cli_evidence_and_an_unknown_gate(gated, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    url, result = gated
    runner = CliRunner()
    out = tmp_path / "cli-bundle"
    res = runner.invoke(app, ["evidence", "--run", result.gate_id, "--out", str(out), "--store", url])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output and _sha256sum_check(out).returncode == 0
    # under a server: the gate's flow runs are linked and their logs bundled, redacted
    assert "/runs/flow-run/" in (out / "SUMMARY.md").read_text()
    assert any(p.name.startswith("prefect-") for p in (out / "logs").iterdir())
    res = runner.invoke(app, ["evidence", "--run", "tiny-cpu-nope-gate-0", "--out", str(tmp_path / "x"),
                              "--store", url])
    assert res.exit_code == 2 and "has no runs/tiny-cpu-nope-gate-0/verdict.json" in res.output


def test_redactor_keeps_hashes_tensor_names_and_urls():
    r = Redactor(hosts=["vm"], users=["ci"], homes=[])
    text = ("git f6a9180d0498b2b8ba44bb740d5105b253afa106 sha " + "a" * 64 +
            " s3://bucket/prefix/blobs fwd/transformer_blocks.1 http://127.0.0.1:4200/api vm ci")
    assert r.text(text) == text  # short names only go in structured fields
    assert r.tree({"host": "vm", "user": "ci", "token_refiner.blocks": ["refiner_norm1"]}) == {
        "host": "<host>", "user": "<user>", "token_refiner.blocks": ["refiner_norm1"]}


def test_second_identical_calibrate_hits_the_cache(gated):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter
    from prefect.utilities.asyncutils import run_coro_as_sync

    url, result = gated
    params = CalibrateParams(store=url, reference_id=result.reference_id)
    first = calibrate_flow(params, return_state=True)
    second = calibrate_flow(params, return_state=True)
    assert second.result()["rule"].rule_sha == first.result()["rule"].rule_sha

    async def states(flow_run_id):
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}),
                                               task_run_filter=TaskRunFilter())
            return {r.name.rsplit("-", 1)[0]: r.state_name for r in runs}

    got = run_coro_as_sync(states(second.state_details.flow_run_id))
    assert got["provider-reports"] == "Cached" and got["calibrate-rule"] == "Cached"
    assert got["write-spread"] == "Cached" and got["resolve-reference"] == "Completed"
    assert (Path(url) / "prefect-results").is_dir()


def test_cache_misses_when_the_store_content_changes(gated, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.utilities.asyncutils import run_coro_as_sync

    url, result = gated
    copy = tmp_path / "copy"
    shutil.copytree(url, copy, ignore=shutil.ignore_patterns("prefect-results"))
    state = calibrate_flow(CalibrateParams(store=str(copy), reference_id=result.reference_id), return_state=True)

    async def names():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]}))
            return {r.state_name for r in runs}

    assert "Cached" not in run_coro_as_sync(names())  # another store URL is another input

