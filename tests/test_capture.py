"""Capture: names, execution order, determinism, streaming into the store, reuse and resume."""

from __future__ import annotations

import torch

from tasks import model as model_lib
from tasks.capture import captured_modules, run_capture
from tasks.providers import CPU_PROVIDERS, FP32_CPU, activate, host_runs_onednn_bf16_gemms, provider_set
from tasks.reference import capture_reference_run


def _capture(model, sample, **kwargs):
    seen: dict[str, tuple[str, int, torch.Tensor]] = {}

    def sink(name, kind, order, tensor):
        assert name not in seen, f"{name} captured twice"
        seen[name] = (kind, order, tensor.clone())

    with activate(FP32_CPU, "cpu"):
        result = run_capture(model, sample, sink, device="cpu", **kwargs)
    return result, seen


def test_names_and_execution_order(tiny_model, tiny_sample):
    result, seen = _capture(tiny_model, tiny_sample, golden_inputs=True)
    params = [n for n, _ in tiny_model.named_parameters()]
    grads = [n for n in result.names if n.startswith("grad/")]
    assert sorted(grads) == sorted(f"grad/{p}" for p in params)  # every parameter exactly once
    orders = [order for _, _, order in result.entries]
    assert orders == list(range(len(orders)))
    last_forward = max(o for n, k, o in result.entries if k in ("fwd", "out", "in"))
    first_backward = min(o for n, k, o in result.entries if k in ("bwd", "grad", "dinput"))
    assert last_forward < first_backward
    names = result.names
    # forward order is real execution order, not name order
    assert names.index("fwd/transformer_blocks.0") < names.index("fwd/transformer_blocks.1")
    assert names.index("fwd/token_refiner") < names.index("fwd/transformer_blocks.0") < names.index("fwd/norm_out")
    # backward runs the other way round
    assert names.index("bwd/transformer_blocks.2") < names.index("bwd/transformer_blocks.0")
    assert names.index("grad/proj_out.weight") < names.index("grad/transformer_blocks.0.norm1.weight")
    assert {"out/sample", "out/audio_sample", "dinput/hidden_states", "dinput/encoder_hidden_states"} <= set(names)
    assert "in/transformer_blocks.0/temb" in names
    # the block's input gradient is what the previous block's output received
    assert seen["bwd/transformer_blocks.1"][2].shape == seen["fwd/transformer_blocks.0"][2].shape


def test_capture_is_deterministic(tiny_model, tiny_sample):
    first, a = _capture(tiny_model, tiny_sample)
    second, b = _capture(tiny_model, tiny_sample)
    assert first.entries == second.entries
    assert all(torch.equal(a[n][2], b[n][2]) for n in a)


def test_node_granularity_adds_inner_modules(tiny_model, tiny_sample):
    blocks = set(captured_modules(tiny_model, "blocks"))
    nodes = set(captured_modules(tiny_model, "nodes"))
    assert blocks < nodes
    assert "transformer_blocks.1.attn.to_q" in nodes and "transformer_blocks.1.ff.net.1" not in nodes
    result, _ = _capture(tiny_model, tiny_sample, granularity="nodes")
    assert "fwd/transformer_blocks.1.attn.norm_q" in result.names
    assert "bwd/token_refiner.refiner_blocks.0.ff.net.0.proj" in result.names


def test_reference_run_streams_dedupes_and_is_byte_identical(store, tiny, tiny_checkpoint, tiny_sample_sha):
    provider = CPU_PROVIDERS["cpu-math"]
    first = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, provider, "bfloat16", "cpu")
    assert not first.reused and first.new_bytes > 0
    manifest = store.read_manifest(first.run_id)
    assert manifest["identity"]["provider"]["name"] == "cpu-math"
    assert "host" in manifest["metadata"] and "host" not in manifest["identity"]
    assert manifest["metadata"]["provider_actual"]["attention_backend"] == "_native_math"
    # a reused run costs nothing
    reused = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, provider, "bfloat16", "cpu")
    assert reused.reused and reused.run_id == first.run_id and reused.manifest_sha == first.manifest_sha
    # regenerating it from scratch gives byte-identical blobs: zero new bytes
    forced = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, provider, "bfloat16", "cpu",
                                   force=True)
    assert forced.new_bytes == 0
    again = store.read_manifest(first.run_id)["tensors"]
    assert {n: r["sha256"] for n, r in again.items()} == {n: r["sha256"] for n, r in manifest["tensors"].items()}
    assert store.verify_run(first.run_id).ok


def test_bf16_providers_really_differ(store, tiny, tiny_checkpoint, tiny_sample_sha):
    """Each provider of this host's CPU set runs other arithmetic than the default (some tensor differs), and oneDNN
    off changes the GEMMs only where oneDNN runs BF16 GEMMs (AVX-512 hosts): elsewhere the two are twins, which
    calibration would measure as one provider (tasks/rules.py), so that host's set has ATen's scalar kernels instead."""
    names = sorted(set(provider_set("cpu")) | {"cpu-no-onednn"})

    def hashes(name):
        run = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, CPU_PROVIDERS[name], "bfloat16",
                                    "cpu")
        return {n: r["sha256"] for n, r in store.read_manifest(run.run_id)["tensors"].items()}

    tensors = {name: hashes(name) for name in names}
    default = tensors["cpu-default"]
    differing = {name: sum(default[n] != h for n, h in hashes_.items()) for name, hashes_ in tensors.items()}
    assert all(differing[name] > 0 for name in provider_set("cpu") if name != "cpu-default"), differing
    assert (differing["cpu-no-onednn"] > 0) == host_runs_onednn_bf16_gemms(), differing


def test_model_fixture_is_float32(tiny_model):
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    assert model_lib.GRAD_INPUTS == ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def test_cpu_references_use_the_same_onednn_kernels_on_every_host(tmp_path):
    """Importing the providers caps oneDNN below Intel AMX (whose BF16 GEMMs round differently), so a CPU
    reference does not depend on whether its host has AMX; the cap is recorded in the run's actual provider."""
    import os
    import subprocess
    import sys

    from tasks.providers import CPU_ONEDNN_MAX_ISA, actual_configuration

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"} | {"ONEDNN_VERBOSE": "1"}
    script = "import tasks.providers, torch; a = torch.ones(64, 64, dtype=torch.bfloat16); a @ a"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    isa = [line for line in out.splitlines() if ",info,cpu,isa:" in line]
    onednn_bf16 = host_runs_onednn_bf16_gemms()
    assert isa or not onednn_bf16, out  # without AVX-512 torch runs BF16 GEMMs in ATen and oneDNN may never start
    assert all("AMX" not in line for line in isa), isa
    with activate(CPU_PROVIDERS["cpu-default"], "cpu"):
        actual = actual_configuration(CPU_PROVIDERS["cpu-default"], "cpu")
        assert actual["onednn_max_cpu_isa"] == CPU_ONEDNN_MAX_ISA and actual["onednn_bf16_gemm"] == onednn_bf16
