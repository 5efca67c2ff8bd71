"""The candidate gate: qualify end to end, a perturbed node, a missing ledger node, tampered evidence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flows.gate import GateParams, gate_flow
from flows.qualify import QualifyParams, qualify_flow
from h3kernels.nodes import CANDIDATE_OPS
from tasks import gate, golden
from tasks.rules import summarize
from tests.host import quick_cpu_providers


def test_qualify_tiny_end_to_end_with_artifacts(prefect_api, tmp_path):
    url = str(tmp_path / "store")
    result = qualify_flow(QualifyParams(store=url, providers=quick_cpu_providers()))
    assert result.passed and result.stage == "verdict", result
    assert result.report_url.endswith("/report.html") and Path(result.report_url.removeprefix("file://")).is_file()
    assert not result.failures and not result.ledger_missing
    from tasks.store import Store

    run = Store(url).read_document(result.gate_id, "verdict.json")["candidate_run"]
    assert run["wall_s"] > 0 and run["reference_load_s"] > 0 and run["reference_preloaded_on"] == "cpu"

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        artifacts = [a for a in client.read_artifacts() if a.key]
    # The harness is shared by the session: other tests publish versions under the same stable keys.
    by_key: dict[str, list] = {}
    for artifact in artifacts:
        by_key.setdefault(artifact.key, []).append(artifact)
    assert {"gate-tiny-cpu-verdict", "gate-tiny-cpu-worst-tensors", "gate-tiny-cpu-report"} <= set(by_key)
    assert any(result.report_url in str(a.data) for a in by_key["gate-tiny-cpu-report"])
    assert any(result.report_url in str(a.data) and "PASS" in str(a.data) for a in by_key["gate-tiny-cpu-verdict"])

    # rerun: the reference and the rule are reused, the gate gives the same verdict
    again = gate_flow(GateParams(store=url))
    assert again.passed and again.gate_id == result.gate_id


def _scaled_attention(scale: float):
    def op(q, k, v, backend, parallel_config):
        return CANDIDATE_OPS["attention"](q * scale, k, v, backend, parallel_config)

    return op


def test_perturbed_node_fails_with_first_drift_there(calibrated_tiny):
    store, preset, checkpoint, reference, rule = calibrated_tiny
    honest = gate.decide(store, rule, gate.run_candidate(store, reference, preset, checkpoint, device="cpu"))
    assert honest.passed, summarize(honest)
    run = gate.run_candidate(store, reference, preset, checkpoint, device="cpu",
                             overrides={("transformer_blocks.1", "attention"): _scaled_attention(1.05)})
    verdict = gate.decide(store, rule, run)
    assert not verdict.passed
    assert verdict.first_drift == "fwd/transformer_blocks.1"
    assert "fwd/transformer_blocks.0" not in verdict.failures
    assert verdict.failures[0] == "fwd/transformer_blocks.1"


def test_missing_ledger_node_fails_the_verdict(calibrated_tiny):
    store, preset, checkpoint, reference, rule = calibrated_tiny
    run = gate.run_candidate(store, reference, preset, checkpoint, device="cpu")
    assert run.missing_nodes == [] and run.ledger["transformer_blocks.2"]["swiglu"]["backward"] == 1
    assert run.reference_preloaded_on == "cpu" and run.reference_load_s > 0  # tiny fits beside the run
    verdict = gate.decide(store, rule, dataclasses.replace(run, missing_nodes=["transformer_blocks.2/swiglu"]))
    assert not verdict.passed and verdict.to_dict()["ledger_missing"] == ["transformer_blocks.2/swiglu"]


def test_reference_feed_preloaded_or_streamed_hands_over_the_same_verified_tensors(calibrated_tiny):
    store, _, _, reference, _ = calibrated_tiny
    records = {n: r for n, r in store.read_manifest(reference.fp32_run)["tensors"].items() if r["kind"] != "in"}
    preloaded, streamed = gate.ReferenceFeed(store, records, "cpu"), gate.ReferenceFeed(store, records, None)
    try:
        assert (preloaded.preloaded_on, streamed.preloaded_on) == ("cpu", None)
        assert preloaded.bytes == streamed.bytes == sum(r["bytes"] for r in records.values())
        for name in sorted(records, key=lambda n: -records[n]["order"]):  # any order the hooks ask in
            expected = store.get_tensor(records[name]["sha256"], name=name)
            for feed in (preloaded, streamed):
                got = feed(name, torch.device("cpu"))
                assert got.dtype == expected.dtype and torch.equal(got, expected), name
    finally:
        preloaded.close()
        streamed.close()


def test_the_reference_is_preloaded_only_onto_one_device_with_room(calibrated_tiny):
    from tasks.placement import Placement
    from tasks.providers import resolve_provider

    _, preset, _, reference, _ = calibrated_tiny
    provider = resolve_provider(reference.default_provider, "cpu")
    layers = preset.config["num_layers"]
    assert gate.preload_device(1 << 20, preset, Placement.single("cpu", layers), provider, "blocks") == "cpu"
    assert gate.preload_device(1 << 60, preset, Placement.single("cpu", layers), provider, "blocks") is None
    split = Placement.parse("cuda:0,cuda:1", layers)  # refused before any device is asked
    assert gate.preload_device(1 << 20, preset, split, provider, "blocks") is None


def test_tampered_reference_blob_stops_the_gate_before_any_model_runs(prefect_api, calibrated_tiny, monkeypatch):
    store, preset, checkpoint, reference, rule = calibrated_tiny
    run_id = reference.provider_runs["cpu-math"]
    record = store.read_manifest(run_id)["tensors"]["grad/transformer_blocks.0.ff.net.2.weight"]
    blob = Path(store.root) / "blobs" / "sha256" / record["sha256"][:2] / record["sha256"]
    original = blob.read_bytes()
    loaded: list[str] = []
    monkeypatch.setattr(gate, "load_model", lambda *a, **k: loaded.append("model") or None)
    blob.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        with pytest.raises(Exception, match="grad/transformer_blocks.0.ff.net.2.weight") as failure:
            gate_flow(GateParams(store=store.url))
        assert record["sha256"] in str(failure.value)
        assert loaded == [] and store.read_document(reference.reference_id, "golden-tests.json") is None
    finally:
        blob.write_bytes(original)


def test_golden_tests_pass_and_catch_a_broken_node(calibrated_tiny, monkeypatch):
    store, preset, checkpoint, reference, _ = calibrated_tiny
    result = golden.run_golden(store, reference, preset, checkpoint, device="cpu")
    assert result["passed"] and len({t["node"] for t in result["tests"]}) == 12
    from h3kernels import nodes

    broken = dict(nodes.CANDIDATE_OPS, swiglu=lambda proj: CANDIDATE_OPS["swiglu"](proj) * (1 + 2**-6))
    monkeypatch.setattr(nodes, "CANDIDATE_OPS", broken)
    result = golden.run_golden(store, reference, preset, checkpoint, device="cpu")
    failed = {t["node"] for t in result["tests"] if t["outcome"] == "failed"}
    assert not result["passed"] and failed == {"swiglu"}


def test_evidence_mismatch_is_named(calibrated_tiny):
    store, preset, checkpoint, reference, rule = calibrated_tiny
    other = dataclasses.replace(checkpoint, sha256="0" * 64)
    with pytest.raises(gate.GateError, match="not the one the reference was made with"):
        gate.verify_evidence(store, reference, rule, other)
    assert torch.cuda.is_available() or gate.prepare_extension("cpu")["warm_s"] >= 0
