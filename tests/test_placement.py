"""Placement (device maps, lanes), the memory planner against real models, refusal, and CPU split identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.memory_plan import GiB, PlanDoesNotFit, meta_model, parse_bytes, plan_memory, trace_model
from tasks.model import (
    CheckpointRef,
    build_sample,
    get_preset,
    load_model,
    model_inputs,
    write_sample,
    write_synthetic_checkpoint,
)
from tasks.placement import (
    BLOCKS,
    INPUT_SIDE,
    OUTPUT_HEAD,
    Placement,
    PlacementError,
    assign_lanes,
    lane_target,
    lanes,
)
from tasks.providers import resolve_provider
from tasks.reference import capture_reference_run
from tasks.store import Store

H200 = 141 * 10**9
BLOCK_MEMORY = Path(__file__).resolve().parents[1] / "bench" / "results" / "block_memory.json"


def _gpus(n):
    return [f"cuda:{i}" for i in range(n)]


def _capacities(n):
    return dict.fromkeys(_gpus(n), H200)


# -- Placement -------------------------------------------------------------------------------------------------------


def test_parse_even_and_counted():
    even = Placement.parse("cuda:0,cuda:1", 50)
    assert even.devices == ("cuda:0", "cuda:1") and even.block_counts == (25, 25)
    assert Placement.parse("cuda:0, cuda:1, cuda:2", 50).block_counts == (17, 17, 16)  # remainder goes first
    counted = Placement.parse("cuda:0=26,cuda:1=24", 50)
    assert counted.block_counts == (26, 24) and counted.num_layers == 50 and counted.is_split
    assert counted.main_device == "cuda:0"
    assert [(r.start, r.stop) for r in counted.ranges()] == [(0, 26), (26, 50)]
    assert counted.describe() == "cuda:0: blocks 0-25, cuda:1: blocks 26-49"
    assert not Placement.single("cpu", 3).is_split
    assert Placement.single("cuda", 3).devices == ("cuda",)


@pytest.mark.parametrize(("spec", "message"), [
    ("cuda:0=26,cuda:1=25", "holds 51 blocks; the model has 50"),
    ("cuda:0=26,cuda:1", "for every entry or for none"),
    ("cuda:0=0,cuda:1=50", "at least one block"),
    ("cuda:0=x,cuda:1=25", "whole number"),
    (",".join(_gpus(51)), "cannot split 50 blocks over 51 devices"),
    ("", "empty placement"),
])
def test_parse_errors(spec, message):
    with pytest.raises(PlacementError, match=message):
        Placement.parse(spec, 50)


def test_bad_device_in_constructor():
    with pytest.raises(PlacementError, match="is not a torch device"):
        Placement(("gpu0",), (3,))


@pytest.mark.parametrize("spec", ["gpu0,cuda:1", "gpu0=25,cuda:1=25"])
def test_parse_bad_device(spec):
    with pytest.raises(PlacementError, match="gpu0"):
        Placement.parse(spec, 50)


def test_device_map_puts_boundaries_first_and_blocks_contiguous():
    placement = Placement.parse("cuda:0=2,cuda:1=2,cuda:2=1", 5)
    mapping = placement.device_map()
    for name in (*INPUT_SIDE, *OUTPUT_HEAD):
        assert mapping[name] == "cuda:0"
    blocks = [mapping[f"{BLOCKS}.{i}"] for i in range(5)]
    assert blocks == ["cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2"]
    assert len(mapping) == len(INPUT_SIDE) + len(OUTPUT_HEAD) + 5
    assert placement.entry_of("transformer_blocks.3.attn.to_q") == 1
    assert placement.entry_of("transformer_blocks.4") == 2
    assert placement.entry_of("proj_out") == 0 and placement.entry_of("token_refiner.blocks.0") == 0


@pytest.mark.parametrize("name", ["tiny", "full"])
def test_device_map_covers_every_parameter_of_the_real_model(name):
    preset = get_preset(name)
    layers = preset.config["num_layers"]
    placement = Placement.even(["cuda:0", "cuda:1", "cuda:2"], layers)
    mapping = placement.device_map()
    model = meta_model(preset, torch.float32)
    for key in mapping:
        model.get_submodule(key)  # every key is a real module
    uncovered = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]
                 if not any(n.startswith(key + ".") for key in mapping)]
    assert uncovered == []
    top = {n for n, _ in model.named_children()}
    assert top == {*INPUT_SIDE, *OUTPUT_HEAD, BLOCKS}
    # each parameter's entry agrees with the device the map gives it
    for n, _ in model.named_parameters():
        key = next(k for k in mapping if n.startswith(k + "."))
        assert placement.devices[placement.entry_of(n)] == mapping[key]


# -- lanes -----------------------------------------------------------------------------------------------------------


def test_provider_runs_lane_plan():
    names = ["default", "flash", "efficient", "cudnn", "math"]
    assert assign_lanes(names, lanes("cpu", "", 1, 0)) == dict.fromkeys(names, "cpu")
    assert assign_lanes(names, lanes("cuda", "", 1, 1)) == dict.fromkeys(names, "cuda")
    assert assign_lanes(names, lanes("cuda:1", "", 1, 4)) == dict.fromkeys(names, "cuda:1")  # pinned stays pinned
    assert assign_lanes(names, lanes("cuda", "", 1, 2)) == {"default": "cuda:0", "flash": "cuda:1",
                                                           "efficient": "cuda:0", "cudnn": "cuda:1", "math": "cuda:0"}
    assert list(assign_lanes(names, lanes("cuda", "", 1, 8)).values()) == [f"cuda:{i}" for i in range(5)]
    assert lanes("cuda", "", 2, 4) == ["cuda:0,cuda:1", "cuda:2,cuda:3"]
    assert lanes("cuda", "", 2, 5) == ["cuda:0,cuda:1", "cuda:2,cuda:3"]  # the odd GPU out idles
    assert assign_lanes(names, lanes("cuda", "", 2, 4))["efficient"] == "cuda:0,cuda:1"
    assert lanes("cuda", "cuda:0=30,cuda:1=20", 1, 8) == ["cuda:0=30,cuda:1=20"]  # an explicit split: one lane
    assert assign_lanes(names, lanes("cuda", "cuda:2,cuda:3", 1, 8)) == dict.fromkeys(names, "cuda:2,cuda:3")


def test_lane_errors():
    with pytest.raises(PlacementError, match="only 2 GPUs are visible"):
        lanes("cuda", "", 4, 2)
    with pytest.raises(PlacementError, match="needs device 'cuda'"):
        lanes("cpu", "", 2, 0)
    with pytest.raises(PlacementError, match="needs device 'cuda'"):
        lanes("cuda:1", "", 2, 4)
    with pytest.raises(PlacementError, match="at least 1"):
        lanes("cuda", "", 0, 4)


def test_lane_target():
    assert lane_target("cuda:0,cuda:1") == ("cuda:0", "cuda:0,cuda:1")
    assert lane_target("cuda:2=30,cuda:3=20") == ("cuda:2", "cuda:2=30,cuda:3=20")
    assert lane_target("cpu") == ("cpu", "")
    assert lane_target("cuda:1") == ("cuda:1", "")


# -- the planner on the tiny preset, against the real loaded model ---------------------------------------------------


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_meta_model_dtypes_match_from_pretrained(store, tiny, tiny_checkpoint):
    loaded = load_model(store, tiny_checkpoint, torch.bfloat16, "cpu")
    meta = meta_model(tiny, torch.bfloat16)
    expected = {n: p.dtype for n, p in loaded.named_parameters()}
    assert {n: p.dtype for n, p in meta.named_parameters()} == expected
    assert {torch.float32, torch.bfloat16} <= set(expected.values())  # _keep_in_fp32_modules really kept some
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in loaded.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_weights_equal_the_loaded_model(store, tiny, tiny_checkpoint, dtype):
    model = load_model(store, tiny_checkpoint, getattr(torch, dtype), "cpu")
    plan = plan_memory(tiny, dtype, Placement.single("cpu", 3))
    assert len(plan.devices) == 1
    assert plan.devices[0].weights == _nbytes(model.parameters()) + _nbytes(model.buffers())


def _saved_bytes(model, sample):
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    saved = [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            saved[0] += storage.nbytes()
        return tensor

    inputs = model_inputs(sample, "cpu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, return_dict=True)
    return saved[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_activations_match_what_autograd_saves(store, tiny, tiny_checkpoint, tiny_sample, dtype):
    model = load_model(store, tiny_checkpoint, getattr(torch, dtype), "cpu")
    real = _saved_bytes(model, tiny_sample)
    planned = plan_memory(tiny, dtype, Placement.single("cpu", 3)).devices[0].activations
    assert real > 0
    assert abs(planned - real) <= 0.005 * real, (planned, real)


def test_split_on_one_device_plans_like_unsplit(tiny):
    capacities = {"cpu": 64 * GiB}
    whole = plan_memory(tiny, "float32", Placement.single("cpu", 3), capacities=capacities)
    split = plan_memory(tiny, "float32", Placement.parse("cpu=1,cpu=2", 3), capacities=capacities)
    assert len(split.devices) == 1 and split.devices[0].blocks == 3
    assert split.devices[0].to_json() == whole.devices[0].to_json()
    assert split.to_json()["placement"] == {"devices": ["cpu", "cpu"], "block_counts": [1, 2]}


def test_trace_attributes_saved_bytes_to_entries(tiny):
    kwargs = dict(fused_attention=True, fused_rms_norm=False, granularity="blocks")
    one = trace_model(tiny, torch.float32, Placement.single("cpu", 3), **kwargs)
    three = trace_model(tiny, torch.float32, Placement.even(["cpu", "cpu", "cpu"], 3), **kwargs)
    assert len(three.saved) == 3 and all(s > 0 for s in three.saved)
    assert sum(three.saved) == one.saved[0]
    assert sum(three.weights) == one.weights[0]
    assert max(three.largest_saved) == one.largest_saved[0]
    # blocks 1 and 2 are identical, so their entries save the same bytes
    assert three.saved[1] == three.saved[2]
    assert three.seq_len == one.seq_len > 0


# -- the planner at real widths (meta-device trace) ------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "gpus", "fits"), [
    ("bfloat16", 1, False), ("bfloat16", 2, False), ("bfloat16", 4, True),
    ("float32", 4, False), ("float32", 8, True),
])
def test_full_model_on_h200s(dtype, gpus, fits):
    full = get_preset("full")
    plan = plan_memory(full, dtype, Placement.even(_gpus(gpus), 50), capacities=_capacities(gpus))
    assert [d.device for d in plan.devices] == _gpus(gpus)
    assert all(d.fits for d in plan.devices) is fits
    assert sum(d.blocks for d in plan.devices) == 50
    # the first device also holds the input side and the head
    assert plan.devices[0].weights >= max(d.weights for d in plan.devices)


def test_full_model_parameter_count():
    plan = plan_memory(get_preset("full"), "float32", Placement.even(_gpus(8), 50), capacities=_capacities(8))
    params = sum(d.weights for d in plan.devices) / 4
    assert 31e9 < params < 35e9


def test_math_attention_plans_the_scores():
    block = get_preset("block")
    placement = Placement.single("cuda:0", 2)
    fused = plan_memory(block, "bfloat16", placement, capacities=_capacities(1))
    math = plan_memory(block, "bfloat16", placement, provider=resolve_provider("math", "cuda"),
                       capacities=_capacities(1))
    assert fused.fused_attention and not math.fused_attention
    assert fused.seq_len == math.seq_len == 16384
    assert math.devices[0].activations - fused.devices[0].activations >= 56 * 16384 * 16384 * 2
    assert math.to_json()["attention"] == "math" and fused.to_json()["attention"] == "fused"


def test_block_float32_fits_one_h200():
    plan = plan_memory(get_preset("block"), "float32", Placement.single("cuda:0", 2), capacities=_capacities(1))
    assert plan.devices[0].fits
    plan.require_fit()


def test_plan_against_measured_block_memory():
    if not BLOCK_MEMORY.exists():
        pytest.skip(f"{BLOCK_MEMORY.relative_to(BLOCK_MEMORY.parents[2])} not written yet "
                    "(python bench/placement.py --preset block --device cuda on a GPU)")
    doc = json.loads(BLOCK_MEMORY.read_text())
    assert doc["machine"] and doc["runs"]
    block = get_preset("block")
    for run in doc["runs"]:
        peak, planned = run["peak_allocated"], run["planned_total"]
        assert peak, run
        assert peak <= planned <= 1.5 * peak, (run["dtype"], planned / peak)
        provider = resolve_provider(run.get("provider") or ("fp32" if run["dtype"] == "float32" else "default"),
                                    "cuda")
        plan = plan_memory(block, run["dtype"], Placement.single("cuda:0", 2), provider=provider,
                           capacities=_capacities(1))
        assert plan.devices[0].total == planned
        assert plan.devices[0].activations == run["planned_activations"]


# -- refusal ---------------------------------------------------------------------------------------------------------


def test_require_fit_names_the_device_and_the_shortfall():
    plan = plan_memory(get_preset("full"), "float32", Placement.single("cuda:0", 50), capacities=_capacities(1))
    with pytest.raises(PlanDoesNotFit, match=r"cuda:0 needs .* GiB usable \(short by [0-9.]+ GiB\)") as info:
        plan.require_fit()
    assert "preset full in float32" in str(info.value) and "NO" in str(info.value)


def test_capture_refuses_a_run_that_cannot_fit(store, tmp_path):
    full = get_preset("full")
    if plan_memory(full, "float32", Placement.single("cpu", 50)).devices[0].fits:
        pytest.skip("this machine's memory holds the full model in float32")
    checkpoint = CheckpointRef(sha256="0" * 64, source="synthetic", config=full.config, weights={})
    with pytest.raises(PlanDoesNotFit, match="cpu needs"):
        capture_reference_run(store, full, checkpoint, "0" * 64, resolve_provider("fp32", "cpu"), "float32", "cpu")
    assert store.list_runs() == []
    root = tmp_path / "store"
    files = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    assert files == []  # nothing loaded, nothing written


# -- CPU split: byte-identical runs ----------------------------------------------------------------------------------


def _fresh_run(root, dtype, provider, placement=None):
    store = Store(str(root))
    preset = get_preset("tiny")
    checkpoint = write_synthetic_checkpoint(store, preset)
    sample_sha = write_sample(store, build_sample(preset.config, preset.sample))
    info = capture_reference_run(store, preset, checkpoint, sample_sha, resolve_provider(provider, "cpu"), dtype,
                                 "cpu", placement=placement)
    return info, store.read_manifest(info.run_id)


@pytest.mark.parametrize(("dtype", "provider"), [("float32", "fp32"), ("bfloat16", "cpu-default")])
def test_cpu_split_is_byte_identical(tmp_path, dtype, provider):
    whole, whole_manifest = _fresh_run(tmp_path / "whole", dtype, provider)
    split, split_manifest = _fresh_run(tmp_path / "split", dtype, provider, Placement.parse("cpu=1,cpu=2", 3))
    assert not whole.reused and not split.reused
    assert split.run_id == whole.run_id
    rows = [(n, r["sha256"], r["order"]) for n, r in whole_manifest["tensors"].items()]
    assert [(n, r["sha256"], r["order"]) for n, r in split_manifest["tensors"].items()] == rows
    assert len(rows) > 50
    meta = split_manifest["metadata"]
    assert meta["placement"] == {"devices": ["cpu", "cpu"], "block_counts": [1, 2]}
    assert meta["memory_plan"]["placement"] == meta["placement"] and meta["memory_plan"]["dtype"] == dtype
    assert whole_manifest["metadata"]["placement"] == {"devices": ["cpu"], "block_counts": [3]}


def test_split_load_attaches_hooks(store, tiny_checkpoint):
    split = load_model(store, tiny_checkpoint, torch.float32, "cpu", Placement.parse("cpu=1,cpu=2", 3))
    whole = load_model(store, tiny_checkpoint, torch.float32, "cpu")
    assert hasattr(split.transformer_blocks[1], "_hf_hook") and hasattr(split.transformer_blocks[0], "_hf_hook")
    assert not any(hasattr(m, "_hf_hook") for m in whole.modules())
    assert not split.training
    assert all(torch.equal(a, b) for a, b in zip(split.state_dict().values(), whole.state_dict().values(),
                                                 strict=True))


# -- CLI -------------------------------------------------------------------------------------------------------------


def test_cli_plan_exit_codes_and_json():
    from typer.testing import CliRunner

    from flows.cli import app

    runner = CliRunner()
    base = ["plan", "--preset", "full", "--dtype", "float32", "--memory", "141GB"]
    res = runner.invoke(app, [*base, "--gpus", "4"])
    assert res.exit_code == 1, res.output
    assert "NO" in res.output and "cuda:3" in res.output
    res = runner.invoke(app, [*base, "--gpus", "8"])
    assert res.exit_code == 0, res.output
    assert "NO" not in res.output and "cuda:7" in res.output
    res = runner.invoke(app, [*base, "--gpus", "8", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert len(doc["devices"]) == 8 and all(d["fits"] and d["capacity"] == H200 for d in doc["devices"])
    assert doc["preset"] == "full" and doc["placement"]["block_counts"] == [7] * 2 + [6] * 6
    res = runner.invoke(app, [*base[:-1], "bogus", "--gpus", "8"])
    assert res.exit_code == 2 and "memory size 'bogus'" in res.output


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("80 GiB") == 80 * GiB
    assert parse_bytes("1024") == 1024
    for bad in ("bogus", "0GB", "-3GB", "12XB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
