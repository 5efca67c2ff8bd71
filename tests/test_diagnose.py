"""Diagnose: localisation of a perturbed node, replace-all == the default provider, probes, CLI/flow end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from h3kernels.nodes import CANDIDATE_OPS
from tasks import diagnose, diagnose_report, rules
from tasks.diagnose_probes import attention_stats


def _scaled_attention(scale: float):
    def op(q, k, v, backend, parallel_config):
        return CANDIDATE_OPS["attention"](q * scale, k, v, backend, parallel_config)

    return op


def test_auto_names_the_perturbed_group_and_block(calibrated_tiny):
    store, preset, checkpoint, reference, rule = calibrated_tiny
    perturbed = {("transformer_blocks.1", "attention"): _scaled_attention(1.05)}
    result = diagnose.run_diagnose(store, reference, rule, preset, checkpoint, device="cpu", auto=True,
                                   replace=["all"], overrides=perturbed)
    doc = result.doc
    assert not doc["baseline"]["passed"] and doc["baseline"]["first_drift"] == "fwd/transformer_blocks.1"
    loc = doc["localisation"]
    assert loc["found"] and loc["mode"] == "fail -> pass", loc
    assert (loc["blocks"], loc["groups"], loc["nodes"]) == (["transformer_blocks.1"], ["attention"], ["attention"])
    assert all({"stage", "label", "worst_ratio", "failing", "meets_target"} <= set(s) for s in loc["steps"])
    assert loc["steps"][-1]["meets_target"] and loc["steps"][-1]["passed"]

    # Replacing every node is diffusers itself: the default provider's stored errors, exactly.
    everything = result.runs[1]
    assert everything.config.pairs and everything.verdict.passed
    report = store.read_document(reference.reference_id, f"report-{reference.default_provider}.json")
    expected = rules.errors_from_report(report)
    got = {name: c.relative_l2 for name, c in everything.run.comparisons.items()}
    assert set(got) == set(expected) and all(got[n] == expected[n] for n in expected)

    # Isolation: the perturbed node creates error; every other node of the block only carries it.
    (block,) = doc["isolation"]
    assert block["block"] == "transformer_blocks.1" and block["overridden"] == ["attention"]
    assert {n["node"] for n in block["nodes"] if n["creates"]} == {"attention"} and len(block["nodes"]) == 12
    assert block["carried_out"]["relative_l2"] > block["carried_out"]["max_provider_error"]

    # Conditioning: one row per attention call (2 refiner + 3 blocks), every figure finite.
    assert [r["block"] for r in doc["conditioning"]][-3:] == [f"transformer_blocks.{i}" for i in range(3)]
    assert len(doc["conditioning"]) == 5
    assert all(math.isfinite(v) for r in doc["conditioning"] for k, v in r.items() if k not in ("block", "node"))
    assert all(0 < r["mean_entropy"] <= r["log_s"] and r["sensitivity_dq"] > 0 for r in doc["conditioning"])

    # Document, report sections, markdown
    sha = diagnose.write_diagnose(store, doc)
    assert store.read_document(doc["run_id"], "diagnose.json") == json.loads(json.dumps(doc))
    assert len(sha) == 64 and doc["run_id"].startswith(f"{reference.reference_id}-diagnose-")
    assert [t for t, _ in diagnose_report.sections(doc)][-1].startswith("Diagnose: attention conditioning")
    assert "attention in transformer_blocks.1" in diagnose_report.markdown(doc, "file:///r.html")


def test_selectors_and_errors(tiny_model):
    units = diagnose.bound_units(tiny_model)
    assert units["transformer_blocks.0"][0] == "adaln_proj" and units["norm_out"] == ("norm_out",)
    assert diagnose.select_blocks(units, "0-1") == ("transformer_blocks.0", "transformer_blocks.1")
    assert diagnose.select_blocks(units, "2,norm_out") == ("transformer_blocks.2", "norm_out")
    assert diagnose.select_blocks(units, None) == tuple(units)
    assert diagnose.select_nodes(["attention", "swiglu"]) == ("attention", "refiner_attention", "swiglu",
                                                              "refiner_swiglu")
    with pytest.raises(ValueError, match="not bound modules"):
        diagnose.select_blocks(units, "7")
    with pytest.raises(ValueError, match="node group"):
        diagnose.select_nodes(["softmax"])
    assert not any("forward" in m.__dict__ for m in tiny_model.modules())  # bound_units unbinds again


def test_attention_stats_flat_attention_is_maximal_entropy():
    import torch

    q = torch.zeros(16, 2, 32)
    k, v = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    stats = attention_stats(q, k, v)
    assert stats["max_logit"] == 0 and stats["mean_entropy"] == pytest.approx(math.log(16))
    # q = 0: p is uniform whatever k is, so dv = p^T g moves with neither k nor v; dq moves with both.
    assert stats["sensitivity_dv"] == 0 and stats["sensitivity_dq"] > 0
    assert all(math.isfinite(x) for x in stats.values())


def test_cli_provider_variant_on_one_block(prefect_api, calibrated_tiny):
    from typer.testing import CliRunner

    from flows.cli import app

    store, _, _, reference, _ = calibrated_tiny
    out = CliRunner().invoke(app, ["diagnose", "--store", store.url, "--provider-variant", "cpu-math",
                                   "--provider-nodes", "attention", "--blocks", "1", "--no-conditioning"])
    assert out.exit_code == 0, out.output
    assert "attention in transformer_blocks.1 under cpu-math" in out.output and "report" in out.output
    run_id = out.output.split("diagnose ")[-1].split()[0]
    doc = store.read_document(run_id, "diagnose.json")
    (config,) = doc["configurations"]
    assert config["provider"] == "cpu-math" and config["blocks"] == {"transformer_blocks.1": ["attention"]}
    assert config["passed"] and doc["conditioning"] == []
    assert Path(store.root, "runs", run_id, "report.html").is_file()

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts() if a.key}
    assert {"diagnose-tiny-cpu", "diagnose-tiny-cpu-runs"} <= keys
