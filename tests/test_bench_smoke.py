"""bench/ scripts on the CPU interpreter: kernel_suite.py --smoke (every section, ~30 s); gate_overhead.py on tiny."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run_bench(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`python <args>` in the checkout on the CPU interpreter; asserts it exited 0. A subprocess, because
    TRITON_INTERPRET must be set before triton is first imported, and the GPU is not wanted here."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_no_bench_script_shadows_an_installed_module() -> None:
    """``python bench/X.py`` puts bench/ first on sys.path, so a script named like a package hides it: a
    bench/kernels.py broke every diffusers import once transformers began to pull in the ``kernels`` package."""
    shadowing = [p.name for p in (ROOT / "bench").glob("*.py") if importlib.util.find_spec(p.stem) is not None]
    assert shadowing == []


@pytest.mark.timeout(120)
def test_kernels_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    proc = _run_bench("bench/kernel_suite.py", "--smoke", "--json", str(out), timeout=110)
    assert "FAILED" not in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["smoke"] and doc["copy"]["verified"]
    ops = {r["op"]: r for r in doc["kernels"]}
    assert set(ops) == {"rms_norm_modulate", "gated_residual", "rms_norm", "qk_norm_rope", "swiglu", "adaln_table"}
    for r in ops.values():
        # Same function as diffusers' bf16 arithmetic, up to bf16 rounding (the interpreter truncates nothing: RNE).
        assert r["max_rel_l2_vs_bf16_baseline"] < 2e-2, r
        assert all(r[side][f"{d}_ms"] > 0 for side in ("candidate", "baseline") for d in ("fwd", "bwd"))
    assert "fwd_ms" in doc["attention"][0]["h3kernels"]
    block = doc["block"]["per_seqlen"]["96"]
    assert block["candidate"]["missing"] == [] and not block["candidate"]["fallbacks"]
    for run in ("default", "candidate"):
        errs = block[run]["rel_l2"]
        assert all(math.isfinite(v) and v < 5e-2 for v in errs.values()), (run, errs)
    # the one table comes last
    assert proc.stdout.rstrip().splitlines()[-1].startswith("block")


@pytest.mark.timeout(300)
def test_gate_overhead_bench_smoke(calibrated_tiny) -> None:
    """bench/gate_overhead.py on tiny: bare, hooked and gated passes and a compare sweep, one table with ratios."""
    store = calibrated_tiny[0]
    proc = _run_bench("bench/gate_overhead.py", store.url, "--preset", "tiny", "--device", "cpu", "--reps", "1",
                      timeout=280)
    rows = dict(line.rsplit(None, 1) for line in proc.stdout.strip().splitlines()[1:])
    bare = float(rows["bare candidate fwd+bwd (median, warm)"])
    gated = float(rows["gate candidate run (capture + compare)"])
    assert 0 < bare and 0 < gated and float(rows["ratio gate run / bare"]) == pytest.approx(gated / bare, abs=0.01)
    again = float(rows["gate candidate run again (warm allocator)"])
    assert float(rows["ratio gate run again / bare"]) == pytest.approx(again / bare, abs=0.01)
    assert all(float(rows[label]) > 0 for label in ("bare candidate fwd+bwd (first pass)",
                                                    "hooked fwd+bwd, tensors dropped (median)",
                                                    "compare of every gated tensor alone"))
    assert int(rows["tensors compared"]) > 100
    assert rows["reference preloaded on"] == "cpu" and float(rows["reference preload (before the run) seconds"]) > 0


@pytest.mark.timeout(120)
def test_kernel_parts_bench_smoke() -> None:
    proc = _run_bench("bench/kernel_parts.py", "--smoke", timeout=110)
    lines = proc.stdout.strip().splitlines()
    assert "row chunks are one table row" in lines[0]
    parts = dict(line.rsplit(None, 1) for line in lines[2:])
    assert len(parts) == 6 and all(float(ms) > 0 for ms in parts.values())
    assert "rms_norm bwd: all" in parts  # the plain norm, next to the modulated one


def test_machine_line_names_the_attention_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bench log's first line (and its JSON's machine record) says which $H3KERNELS_ATTN_CONFIG was in force:
    a sweep's block runs differ only there."""
    from bench import block

    monkeypatch.setenv("H3KERNELS_ATTN_CONFIG", "dq_fused=1,dkdv_m=16")
    info = block.machine()
    assert info["attn_config"] == "dq_fused=1,dkdv_m=16"
    assert block.machine_line(info, "", "SMOKE").endswith(" | attention dq_fused=1,dkdv_m=16 | SMOKE")
    monkeypatch.delenv("H3KERNELS_ATTN_CONFIG")
    info = block.machine()
    assert info["attn_config"] == "" and "attention" not in block.machine_line(info)


@pytest.mark.timeout(120)
def test_block_profile_bench_smoke() -> None:
    """bench/block_profile.py on tiny: both runs profiled, categories and kernels tabled, the table last."""
    proc = _run_bench("bench/block_profile.py", "--smoke", "--top", "5", timeout=110)
    lines = proc.stdout.strip().splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("section"))):]
    total = next(ln for ln in table if "total device time per pass" in ln).split()
    default, candidate = float(total[-4]), float(total[-3])
    assert default > 0 and candidate > 0
    assert any(ln.startswith("category  attention (h3kernels)") for ln in table)  # the candidate's own attention
    passes = [ln for ln in table if ln.startswith("pass ")]
    assert len(passes) == 2 and all(float(ln.split()[-4]) > 0 for ln in passes[:1])
    assert sum(ln.startswith("kernel ") for ln in table) == 5


@pytest.mark.timeout(120)
def test_adaln_tiles_bench_smoke() -> None:
    """bench/adaln_tiles.py on tiny: the torch row and one tile row, checked against torch, the table last."""
    proc = _run_bench("bench/adaln_tiles.py", "--smoke", timeout=110)
    last = proc.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("torch (bf16") and last[1].startswith("h3kernels 128x128x4")
    assert float(last[1].split()[-1]) < 2e-2  # the candidate computes the same table as torch, up to bf16


@pytest.mark.timeout(120)
def test_attention_inputs_bench_captures_the_block_attention(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/attention_inputs.py on tiny (in-process: conftest runs the kernels under TRITON_INTERPRET=1): the
    block-0 attention node's q, k, v and output gradient, as bf16 [1, S, NH, D] tensors, then the smoke report."""
    from bench import attention_inputs

    q, k, v, do = attention_inputs.capture("tiny", 96, torch.device("cpu"))
    assert {t.shape for t in (q, k, v, do)} == {torch.Size([1, 96, 4, 32])}
    assert {t.dtype for t in (q, k, v, do)} == {torch.bfloat16}
    assert q.requires_grad and not do.requires_grad and all(float(t.detach().abs().max()) > 0 for t in (q, k, v, do))
    assert not torch.equal(q, k)  # two different projections, not one tensor captured twice
    assert attention_inputs.main(["--smoke"]) == 0
    assert capsys.readouterr().out.strip().endswith("timing needs CUDA: captured the four tensors only")


@pytest.mark.timeout(150)
def test_knob_sweep_bench_smoke(tmp_path: Path) -> None:
    """bench/knob_sweep.py on tiny: each group's smoke setting runs its ops both ways, close to torch, tabled."""
    out = tmp_path / "sweep.json"
    proc = _run_bench("bench/knob_sweep.py", "--smoke", "--json", str(out), timeout=140)
    records = json.loads(out.read_text())["records"]
    got = {(r["op"], r["dir"]) for r in records if "error" not in r}
    ops = ("rms_norm_modulate", "rms_norm", "qk_norm_rope", "gated_residual", "adaln_table")
    assert got == {(op, d) for op in ops for d in ("fwd", "bwd")}
    assert all(0 <= r["rel_l2_vs_bf16_torch"] < 2e-2 for r in records)
    assert "best first per op and direction" in proc.stdout and "BAD" not in proc.stdout


def test_knob_sweep_apply_sets_restores_and_rejects_unknown_constants() -> None:
    from bench.knob_sweep import apply, parse_setting
    from h3kernels import residual

    before = residual.GATED_WARPS
    old = apply({"residual.GATED_WARPS": before * 2})
    assert residual.GATED_WARPS == before * 2 and old == {"residual.GATED_WARPS": before}
    apply(old)
    assert residual.GATED_WARPS == before
    with pytest.raises(AttributeError, match="no constant GATED_WRAPS"):
        apply({"residual.GATED_WRAPS": 4})
    assert parse_setting("residual.GATED_WARPS=4,qk_norm_rope.QK_BWD_ROWS=8") == {
        "residual.GATED_WARPS": 4, "qk_norm_rope.QK_BWD_ROWS": 8}
    assert parse_setting("") == {}
    for bad in ("GATED_WARPS=4", "residual.GATED_WARPS", "residual.GATED_WARPS=four"):
        with pytest.raises(ValueError, match="bad --setting item"):
            parse_setting(bad)


@pytest.mark.timeout(120)
def test_fused_dq_error_bench_smoke() -> None:
    """bench/fused_dq_error.py on the interpreter: the fixed point's error is a small part of bf16's, the int32
    headroom holds, o/dk/dv keep their bytes (the script exits 1 otherwise)."""
    proc = _run_bench("bench/fused_dq_error.py", "--smoke", timeout=110)
    row = proc.stdout.strip().splitlines()[-1].split()
    rel_separate, rel_fused, fused_vs_separate, headroom = (float(row[i]) for i in (1, 2, 3, 6))
    assert row[0] == "randn" and row[-1] == "yes"
    assert 1e-4 < rel_separate < 1e-2 and abs(rel_fused - rel_separate) < 0.05 * rel_separate
    assert fused_vs_separate < 0.1 * rel_separate and 0 < headroom <= 0.5
