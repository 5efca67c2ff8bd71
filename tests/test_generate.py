"""The generation gate on tiny, 4 schedule points (3 evaluations): pass, perturbed node, refusal, determinism."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from h3kernels.nodes import CANDIDATE_OPS
from tasks import gate
from tasks import generate as gen
from tasks.calibration import load_rule
from tasks.generate_report import build_generate_report, step_table
from tasks.providers import host_runs_onednn_bf16_gemms

STEPS = 4  # set_timesteps(4): 4 sigma points, the terminal 0 included, so 3 model evaluations


@pytest.fixture(scope="module")
def gated_tiny(calibrated_tiny):
    """The calibrated tiny reference with a passing numerical gate (its pointer written by write_gate_documents)."""
    store, preset, checkpoint, reference, rule = calibrated_tiny
    run = gate.run_candidate(store, reference, preset, checkpoint, device="cpu")
    verdict = gate.decide(store, rule, run)
    assert verdict.passed
    gid = gate.gate_id(reference, rule, run.candidate)
    gate.write_gate_documents(store, gid, verdict, run, {"gate_id": gid, "reference_id": reference.reference_id})
    return store, preset, checkpoint, reference, gid


def _scaled_attention(scale: float):
    def op(q, k, v, backend, parallel_config):
        return CANDIDATE_OPS["attention"](q * scale, k, v, backend, parallel_config)

    return op


def _noisy_swiglu(proj):
    out = CANDIDATE_OPS["swiglu"](proj)
    # Noise well under one BF16 ulp of most values, added in float32 so that it flips the rounding of some; the
    # global RNG moves on, so the second trajectory differs.
    return (out.float() + 1e-3 * torch.randn_like(out, dtype=torch.float32)).to(out.dtype)


def test_generation_gate_of_the_candidate(gated_tiny):
    """The candidate passes where oneDNN runs the BF16 GEMMs (AVX-512 hosts). FINDING: where it does
    not (ATen's GEMMs; measured on an AVX-512 host with oneDNN off and ATEN_CPU_CAPABILITY=avx2) every provider is
    more accurate on the final audio latents (max error 5.28e-3 against the candidate's 5.75e-3), k is 1.08 and the
    candidate fails there at 1.007 x its bound; on a real AVX2 host (the CI host) step2/audio_velocity fails too, at
    1.046 x, and final/audio_latents at 1.146 x. Only audio tensors of the last step fail, each within 20% of its
    bound."""
    store, preset, checkpoint, reference, gid = gated_tiny
    outcome = gen.run_generate(store, reference, preset, checkpoint, device="cpu", num_steps=STEPS)
    doc = outcome.doc
    failures = doc["failures"]
    onednn = host_runs_onednn_bf16_gemms()
    if onednn:
        assert failures == [], (failures, doc["worst_step"])
    else:  # the finding's tensors may fail (other AVX2 CPUs may round elsewhere), and nothing else
        assert set(failures) <= {"final/audio_latents", f"step{STEPS - 2}/audio_velocity"}, failures
    assert doc["passed"] == doc["numerically_passed"] == (not failures)
    ratios = {t["name"]: t["ratio"] for t in outcome.verdict["tensors"]}
    assert all(ratios[name] < 1.2 for name in failures), {name: ratios[name] for name in failures}
    assert doc["determinism"] == {"deterministic": True, "events": 12, "first_mismatch": None}
    assert doc["model_evaluations"] == 3 and [r["step"] for r in doc["steps"]] == [0, 1, 2]
    names = [t["name"] for t in outcome.verdict["tensors"]]
    assert names[:2] == ["step0/video_velocity", "step0/audio_velocity"] and names[-2:] == list(gen.FINAL_TENSORS)
    assert doc["gate_id"] == gid and outcome.generate_id.startswith(f"{gid}-generate-")
    worst_step_limit = 1 if onednn else 1.2
    assert doc["worst_step"]["tensor"].startswith("step") and doc["worst_step"]["ratio"] <= worst_step_limit
    assert set(doc["provider_final"]) == set(reference.provider_runs)
    for metrics in doc["final"].values():
        assert metrics["cosine"] > 0.999 and metrics["psnr_db"] > 30 and metrics["relative_l2"] < 0.05
    assert doc["rule"]["k"] >= 1 and sorted(outcome.rule["providers"]) == sorted(reference.provider_runs)

    sha = gen.write_generate_document(store, outcome)
    path = Path(store.root) / "runs" / outcome.generate_id / "generate.json"
    assert json.loads(path.read_text())["schema"] == gen.GENERATE_SCHEMA and store.get_json(sha)["passed"]
    html = build_generate_report(outcome)
    assert "Velocity error per step" in html and "Final latents" in html and "deterministic" in html
    assert len(step_table(doc)) == 3 and "video_providers" not in step_table(doc)[0]


def test_perturbed_node_fails_naming_the_step(gated_tiny):
    store, preset, checkpoint, reference, _ = gated_tiny
    outcome = gen.run_generate(store, reference, preset, checkpoint, device="cpu", num_steps=STEPS,
                               overrides={("transformer_blocks.1", "attention"): _scaled_attention(1.05)})
    doc = outcome.doc
    assert not doc["passed"] and not doc["numerically_passed"]
    assert doc["first_failing_step"] == 0 and doc["first_failure"].startswith("step0/")
    assert "final/video_latents" in doc["failures"] and doc["worst_step"]["ratio"] > 1
    assert doc["overrides"] == ["transformer_blocks.1/attention"] and doc["determinism"]["deterministic"]
    assert "over the bound" in build_generate_report(outcome)


def test_refuses_without_a_passing_numerical_verdict(gated_tiny, monkeypatch):
    store, preset, checkpoint, reference, gid = gated_tiny
    loaded: list[str] = []
    monkeypatch.setattr(gen, "load_model", lambda *a, **k: loaded.append("model"))
    # A candidate (a subset of nodes) the numerical gate never judged: refused before any model loads.
    with pytest.raises(gen.MissingVerdict, match="refs/passing-verdicts/tiny-cpu-.*h3gate gate --preset tiny"):
        gen.run_generate(store, reference, preset, checkpoint, device="cpu", num_steps=STEPS, nodes=["swiglu"])
    # A failing numerical verdict (here: nothing compared) writes no pointer.
    identity = gen.candidate_identity(preset.config, ["norm_out"])
    failing_run = _empty_run(identity)
    failing = gate.decide(store, load_rule(store, reference.reference_id), failing_run)
    assert not failing.passed
    gate.write_gate_documents(store, "failing-gate", failing, failing_run,
                              {"gate_id": "failing-gate", "reference_id": reference.reference_id})
    with pytest.raises(gen.MissingVerdict):
        gen.require_passing_verdict(store, reference, identity)
    assert loaded == []
    # The passing one is found, and a checkpoint other than the reference's is refused.
    assert gen.require_passing_verdict(store, reference, gen.candidate_identity(preset.config))["gate_id"] == gid
    with pytest.raises(gen.GenerateError, match="is not the reference's"):
        gen.run_generate(store, reference, preset, dataclasses.replace(checkpoint, sha256="0" * 64), device="cpu")


def _empty_run(candidate):
    return gate.CandidateRun(comparisons={}, order={}, ledger={}, missing_nodes=[], candidate=candidate, wall_s=0.0,
                             peak_device_bytes=None)


def test_determinism_check_catches_injected_nondeterminism(gated_tiny):
    store, preset, checkpoint, reference, _ = gated_tiny
    outcome = gen.run_generate(store, reference, preset, checkpoint, device="cpu", num_steps=STEPS,
                               overrides={("transformer_blocks.2", "swiglu"): _noisy_swiglu})
    det = outcome.doc["determinism"]
    assert not outcome.doc["passed"] and not det["deterministic"]
    assert det["first_mismatch"] == {"step": 0, "tensor": "model_output/sample"}
    assert "NOT deterministic" in build_generate_report(outcome)


def test_cli_generate_runs_the_flow_with_artifacts(prefect_api, gated_tiny):
    from prefect.client.orchestration import get_client
    from typer.testing import CliRunner

    from flows.cli import app

    store, _, _, reference, gid = gated_tiny
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "--store", store.url, "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and f"generate {gid}-generate-" in result.output and "PSNR" in result.output
    generate_id = result.output.split("generate ", 1)[1].split()[0]
    assert store.read_document(generate_id, "generate.json")["model_evaluations"] == 2
    assert (Path(store.root) / "runs" / generate_id / "report.html").is_file()
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts() if a.key}
    assert {"generate-tiny-cpu-verdict", "generate-tiny-cpu-worst-tensors", "generate-tiny-cpu-steps",
            "generate-tiny-cpu-report"} <= keys

    refused = runner.invoke(app, ["generate", "--store", store.url, "--steps", "3", "--nodes", "swiglu"])
    assert refused.exit_code == 2 and "no passing numerical verdict" in refused.output
