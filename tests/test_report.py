"""tasks/report.py: the self-contained HTML drift report, tables, markdown, store and Prefect artifacts.

The inputs come from the real rules code (calibrate + verdict on a synthetic ~100-tensor inventory of
a 3-block model, 3 providers), serialised through ``to_json`` exactly as the store holds them, so
non-finite values arrive as the strings "inf"/"nan".
"""

from __future__ import annotations

import hashlib
import json
import random
import re

import pytest
from plotly.offline import get_plotlyjs

from tasks import report, rules

# A string that occurs once in the plotly.js bundle: its licence header.
PLOTLY_MARKER = "* plotly.js v"
BLOCK_PARAMS = ("adaln_proj.linear.weight", "adaln_proj.linear.bias", "attn.to_q.weight", "attn.to_k.weight",
                "attn.to_v.weight", "attn.norm_q.weight", "attn.norm_k.weight", "attn.to_out.0.weight",
                "ff.net.0.proj.weight", "ff.net.2.weight", "norm1.weight", "norm2.weight")
REFINER_PARAMS = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.0.weight",
                  "ff.net.0.proj.weight", "ff.net.2.weight", "adaln.linear.weight")
FAILING = "grad/transformer_blocks.1.attn.norm_q.weight"
NONFINITE = "bwd/transformer_blocks.0"
FIRST_DRIFT = "fwd/transformer_blocks.1.attn"
PROVIDERS = ("default", "efficient", "math")


def inventory(blocks: int = 3) -> list[str]:
    """Tensor names in execution order, as capture.py names them (forward hooks, then backward)."""
    fwd = ["fwd/proj_in", "fwd/audio_proj_in", "fwd/context_embedder", "fwd/time_embedder",
           "fwd/token_refiner.refiner_blocks.0", "in/transformer_blocks.0/hidden_states",
           "in/transformer_blocks.0/temb"]
    for b in range(blocks):
        fwd += [f"fwd/transformer_blocks.{b}.attn", f"fwd/transformer_blocks.{b}.ff", f"fwd/transformer_blocks.{b}"]
    fwd += ["fwd/norm_out", "fwd/proj_out", "fwd/audio_proj_out", "out/sample", "out/audio_sample"]
    bwd = ["bwd/audio_proj_out", "grad/audio_proj_out.weight", "grad/audio_proj_out.bias", "bwd/proj_out",
           "grad/proj_out.weight", "grad/proj_out.bias", "bwd/norm_out", "grad/norm_out.linear.weight"]
    for b in reversed(range(blocks)):
        bwd += [f"bwd/transformer_blocks.{b}", f"bwd/transformer_blocks.{b}.ff", f"bwd/transformer_blocks.{b}.attn"]
        bwd += [f"grad/transformer_blocks.{b}.{p}" for p in reversed(BLOCK_PARAMS)]
    bwd += ["bwd/token_refiner.refiner_blocks.0"]
    bwd += [f"grad/token_refiner.refiner_blocks.0.{p}" for p in REFINER_PARAMS]
    bwd += ["grad/token_refiner.final_norm.weight", "grad/time_embedder.linear_2.weight",
            "grad/time_embedder.linear_1.weight", "grad/context_embedder.weight", "grad/context_embedder.bias",
            "grad/audio_proj_in.weight", "grad/audio_proj_in.bias", "grad/proj_in.weight", "grad/proj_in.bias",
            "dinput/hidden_states", "dinput/audio_hidden_states", "dinput/encoder_hidden_states"]
    return fwd + bwd


def synthetic(*, fail: bool = True, seed: int = 0) -> dict:
    """verdict, provider_errors, rule dicts (as read back from the store) and an identity."""
    rng = random.Random(seed)
    names = inventory()
    order = {n: i for i, n in enumerate(names)}
    errors: dict[str, dict[str, float]] = {p: {} for p in PROVIDERS}
    for n in names:
        base = 0.0 if n.startswith("in/") else 10 ** rng.uniform(-2.6, -1.2)  # block inputs are copied exactly
        for p in PROVIDERS:
            errors[p][n] = base * rng.uniform(0.8, 1.25)
    rule = rules.calibrate(errors, rules.derive_floor(None), reference_manifest_sha="ab" * 32,
                           floor_method=rules.floor_method(None))
    candidate: dict[str, object] = {}
    for n in names:
        m = rule.max_provider_error[n]
        candidate[n] = (m * rng.uniform(0.7, 0.98), m * 7.5, 0)
    candidate[FIRST_DRIFT] = (rule.max_provider_error[FIRST_DRIFT] * 1.02, 0.5, 0)  # above every provider, in bound
    ledger: list[str] = []
    if fail:
        candidate[FAILING] = (3.0 * rules.ensemble_bound(rule.k, rule.max_provider_error[FAILING], rule.floor), 2.0, 0)
        candidate[NONFINITE] = (float("inf"), float("inf"), 3)
        ledger = ["transformer_blocks.2.swiglu"]
    single = rules.single_provider_bounds(errors["default"], rule.floor)
    v = rules.verdict(candidate, rule, order, single_bounds=single, ledger_missing=ledger)
    identity = {"title": "tiny preset, candidate h3kernels", "preset": "tiny", "device": "cpu",
                "reference": "ref-tiny-0001", "candidate run": "cand-tiny-0042",
                "reference manifest": "ab" * 32, "candidate manifest": "cd" * 32, "rule hash": "ef" * 32,
                "kernel versions": {"h3kernels": "0.1.0", "triton": "3.9.0"}, "created": "2026-12-02T16:00:00Z"}
    return {"verdict": json.loads(v.to_json()), "provider_errors": errors, "rule": json.loads(rule.to_json()),
            "identity": identity}


@pytest.fixture(scope="module")
def data() -> dict:
    return synthetic()


@pytest.fixture(scope="module")
def page(data) -> str:
    return report.build_report(data["verdict"], data["provider_errors"], data["rule"], data["identity"])


def test_synthetic_inputs_are_realistic(data):
    v = data["verdict"]
    assert 90 <= v["compared"] <= 110 and len(data["provider_errors"]) == 3
    assert v["failures"] == [FAILING, NONFINITE]  # execution order: block 1's gradients before block 0's backward
    assert v["first_drift"]["tensor"] == FIRST_DRIFT and v["worst"]["ratio"] == "inf"


def test_html_is_self_contained_with_plotly_once(page):
    assert page.count(PLOTLY_MARKER) == 1
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"<script[^>]+src=", page), "every script is inline"
    assert not re.search(r"<link\b|@import|url\(", page.replace(get_plotlyjs(), "")), "no stylesheets or fonts fetched"
    ours = page.replace(get_plotlyjs(), "")  # the bundle names map-tile servers that a plain chart never loads
    assert "plotly.js v" not in ours and not re.search(r"https?://", ours), "no network references in our markup"
    for div in ("h3-errors", "h3-heatmap", "h3-calibration"):
        assert page.count(f'id="{div}"') == 1
    assert page.count("Plotly.newPlot") == 3


def test_html_states_the_verdict(page, data):
    body = page.split("</head>", 1)[1]
    assert '<div class="badge fail">FAIL</div>' in body
    assert FIRST_DRIFT in body and FAILING in body and NONFINITE in body
    assert "transformer_blocks.2.swiglu" in body  # the ledger node that never ran
    assert "ref-tiny-0001" in body and "ef" * 32 in body and "triton: " in body  # identity table, nested values
    assert data["rule"]["floor_method"].split(":")[0] in body
    passed = synthetic(fail=False)
    ok = report.build_report(passed["verdict"], passed["provider_errors"], passed["rule"], passed["identity"])
    assert '<div class="badge pass">PASS</div>' in ok and "FAIL" not in ok.split("</head>", 1)[1].replace(
        "candidate, FAIL", "")


def test_report_when_nothing_was_compared(data):
    rule = rules.EnsembleRule.from_json(data["rule"])
    order = {n: i for i, n in enumerate(inventory())}
    v = json.loads(rules.verdict({}, rule, order, ledger_missing=["transformer_blocks.0.qkv"]).to_json())
    page = report.build_report(v, data["provider_errors"], data["rule"], {"title": "empty candidate"})
    body = page.split("</head>", 1)[1]
    assert page.count(PLOTLY_MARKER) == 1 and "FAIL</div>" in body and "nothing compared" in body
    assert "dinput/encoder_hidden_states" in body  # the missing tensors are named
    assert report.worst_rows(v) == [] and "**FAIL**" in report.verdict_markdown(v, {}, "memory://r/report.html")


def test_report_is_deterministic(data, page):
    again = report.build_report(data["verdict"], data["provider_errors"], data["rule"], data["identity"])
    assert again == page


def test_worst_rows_order(data):
    rows = report.worst_rows(data["verdict"])
    assert len(rows) == 20 and [r["rank"] for r in rows] == list(range(1, 21))
    assert rows[0]["tensor"] == NONFINITE and rows[0]["ratio"] == "inf" and not rows[0]["passed"]
    assert rows[1]["tensor"] == FAILING and rows[1]["ratio"] == pytest.approx(3.0, rel=1e-3)
    ratios = [float(r["ratio"]) for r in rows]
    assert ratios == sorted(ratios, reverse=True)
    json.dumps(rows, allow_nan=False)  # a Prefect table artifact must be strict JSON
    assert len(report.worst_rows(data["verdict"], n=500)) == data["verdict"]["compared"]


@pytest.mark.parametrize(("name", "block"), [
    ("grad/transformer_blocks.12.attn.to_q.weight", "transformer_blocks.12"),
    ("fwd/transformer_blocks.1", "transformer_blocks.1"),
    ("bwd/transformer_blocks.3.attn", "transformer_blocks.3"),
    ("grad/token_refiner.refiner_blocks.0.ff.net.0.proj.weight", "token_refiner.refiner_blocks.0"),
    ("grad/token_refiner.final_norm.weight", "token_refiner"),
    ("fwd/proj_in", "proj_in"),
    ("grad/proj_in.bias", "proj_in"),
    ("grad/time_embedder.linear_1.weight", "time_embedder"),
    ("in/transformer_blocks.0/hidden_states", "transformer_blocks.0"),
    ("out/sample", "output"),
    ("dinput/hidden_states", "input"),
])
def test_block_of(name, block):
    assert report.block_of(name) == block


def test_heatmap_cells(data):
    fig = report.heatmap_figure(data["verdict"])
    hm = fig.data[0]
    rows, kinds = list(hm.y), list(hm.x)
    assert kinds == [k for k in report.KIND_ORDER if k in kinds]
    assert {"transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2", "proj_in",
            "token_refiner.refiner_blocks.0", "output", "input"} <= set(rows)
    cell = hm.customdata[rows.index("transformer_blocks.1")][kinds.index("grad")]
    assert cell[0] == FAILING and cell[2] == "FAIL" and cell[1] == len(BLOCK_PARAMS)
    assert hm.text[rows.index("transformer_blocks.0")][kinds.index("bwd")] == "inf"
    assert hm.z[rows.index("output")][kinds.index("grad")] is None  # no such tensors: an empty cell


def test_redaction_of_home_host_and_secrets(data, monkeypatch):
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.setattr(report.socket, "gethostname", lambda: "gpu-node-17.lab.example")
    ident = dict(data["identity"], checkpoint="/home/alice/ckpts/h3.safetensors", host="gpu-node-17.lab.example",
                 worker="worker on gpu-node-17", store="s3://ak:sk@bucket/h3", api_token="tok-SECRET-123")
    extra = [("Notes", "<p>log at /home/alice/run.log on gpu-node-17</p>")]
    page = report.build_report(data["verdict"], data["provider_errors"], data["rule"], ident, extra)
    body = page.split("</head>", 1)[1]
    for leaked in ("/home/alice", "gpu-node-17", "tok-SECRET-123", "ak:sk"):
        assert leaked not in body
    assert "~/ckpts/h3.safetensors" in body and "&lt;host&gt;" in body and "***" in body
    md = report.verdict_markdown(data["verdict"], ident, "file:///tmp/x/report.html")
    assert "gpu-node-17" not in md and "/home/alice" not in md
    assert report.default_redactor("/root", "box")("/rootfs and /root/x") == "/rootfs and ~/x"
    assert report.default_redactor("/root", "ci")("ci is too short to redact") == "ci is too short to redact"
    plain = report.build_report(data["verdict"], data["provider_errors"], data["rule"], {"text tokens": 77})
    assert "<td><span class=\"mono\">77</span>" in plain  # only secret-looking keys are masked
    assert report.build_report(data["verdict"], data["provider_errors"], data["rule"], ident,
                               redact=lambda s: s).count("/home/alice/ckpts") == 1  # the hook can be turned off


def test_extra_sections_take_html_and_figures(data, monkeypatch):
    monkeypatch.setattr(report.socket, "gethostname", lambda: "gpu-node-17")
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    fig.update_layout(title="node drift on gpu-node-17")
    page = report.build_report(data["verdict"], data["provider_errors"], data["rule"], data["identity"],
                               [("Diagnosis", fig), ("Self-test", "<p id='selftest'>12 of 12 checks</p>")])
    assert page.count(PLOTLY_MARKER) == 1 and page.count("Plotly.newPlot") == 4
    assert "6 · Diagnosis" in page and "7 · Self-test" in page and "<p id='selftest'>" in page
    assert "node drift on \\u003chost\\u003e" in page or "node drift on <host>" in page  # figure text redacted


def test_verdict_markdown(data):
    md = report.verdict_markdown(data["verdict"], data["identity"], "s3://bucket/h3/runs/r1/report.html")
    assert md.startswith("## h3gate verdict: **FAIL**")
    assert f"`{NONFINITE}` at inf" in md and f"`{FIRST_DRIFT}` (order " in md
    assert "[Drift report](s3://bucket/h3/runs/r1/report.html)" in md and "transformer_blocks.2.swiglu" in md


def test_store_report_writes_blob_and_document(store, page):
    url, sha = report.store_report(store, page, run_id="cand-tiny-0042")
    data = page.encode()
    assert sha == hashlib.sha256(data).hexdigest() and store.get_bytes(sha) == data
    assert url == f"{store.url}/runs/cand-tiny-0042/report.html"
    path = f"{store.root}/runs/cand-tiny-0042/report.html"
    assert store.fs.cat_file(path) == data
    assert report.store_report(store, page, run_id="cand-tiny-0042") == (url, sha)  # rewrite is idempotent
    with pytest.raises(ValueError):
        report.store_report(store, page, run_id="../escape")


def test_store_report_memory_filesystem(page):
    from tasks.store import Store

    store = Store("memory://h3gate-report-test")
    url, sha = report.store_report(store, page, run_id="r1")
    assert url == "memory://h3gate-report-test/runs/r1/report.html"
    assert store.fs.cat_file(f"{store.root}/runs/r1/report.html") == page.encode()


def test_publish_artifacts(prefect_api, data):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    @task
    def publish() -> dict:
        return report.publish_artifacts(data["verdict"], data["identity"], "file:///store/runs/r1/report.html",
                                        key_prefix="gate-tiny")

    @flow
    def gate_flow() -> list:
        publish()
        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="gate-tiny-")))

    arts = {a.key: a for a in gate_flow()}
    assert set(arts) == {"gate-tiny-verdict", "gate-tiny-worst-tensors", "gate-tiny-report"}
    assert arts["gate-tiny-verdict"].type == "markdown" and "**FAIL**" in arts["gate-tiny-verdict"].data
    table = arts["gate-tiny-worst-tensors"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert table[0]["tensor"] == NONFINITE and len(table) == 20
    assert "(file:///store/runs/r1/report.html)" in arts["gate-tiny-report"].data
    with pytest.raises(ValueError, match="kebab-case"):
        report.publish_artifacts(data["verdict"], data["identity"], "x", key_prefix="Gate_Tiny")
