"""The binding: the node chain is the diffusers model, the candidate bound into it runs everywhere and is counted.

Runs go through `tasks.capture.run_capture` (the gate's own forward+backward with the sample's seeded upstream
gradients and module hooks on every block), so these tests also prove that hooks fire on bound blocks. The tiny
preset runs on the CPU under TRITON_INTERPRET=1 (conftest) or on CUDA when present; the small preset is gpu-marked.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from h3kernels import ALL_NODES, BLOCK_NODES, BOUNDARY_NODES, NODE_GROUPS, REFINER_NODES, NodeFallback, bind, unbind
from h3kernels._common import KernelInputError
from h3kernels.nodes import CANDIDATE_OPS, REFERENCE_OPS
from tasks.capture import run_capture
from tasks.model import build_sample, get_preset, load_model, model_inputs, write_synthetic_checkpoint
from tasks.store import Store
from tests.kernels.harness import DEVICE, HAS_CUDA, reproducible

TINY_BLOCKS = ["transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2"]
TINY_REFINERS = ["token_refiner.refiner_blocks.0", "token_refiner.refiner_blocks.1"]
# Why these bounds: fp32 kernels differ from torch only in summation order (measured max 1.3e-6 on the tiny
# preset, every tensor); a wrong index, chunk or scale is O(1).
FP32_REL = 1e-4
# bf16, the adaln_proj weight gradients against diffusers' worst BF16 provider. On the CPU, diffusers'
# index_select backward accumulates in fp32 (torch's CPU index_add), so the fp32 table only trims its bf16
# roundings (measured 0.73-0.89x on tiny). On CUDA diffusers scatter-adds in bf16 with atomics, which the
# fp32 table removes; how much that weighs grows with the tokens per table row (DESIGN 7, modulation.py:
# ~0.16 rel-L2 at S=16384): 0.70x on tiny's block 2 (H200, session 11), within 0.5x at small's S=2056.
ADALN_RATIO = {"tiny": 1.0, "small": 0.5}
# Any other tensor may sit at most this far above diffusers' own bf16 error (measured max 1.05x: last-bit luck
# of a per-head norm weight); a broken kernel is many times worse.
BF16_ANY_RATIO = 1.25


def rel_l2(c: torch.Tensor, r: torch.Tensor) -> float:
    c, r = c.detach().double().cpu(), r.detach().double().cpu()
    return float((c - r).norm() / r.norm()) if r.norm() > 0 else float((c - r).norm())


def capture(model, sample, device=DEVICE) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}

    def sink(name, kind, order, tensor):
        tensors[name] = tensor.clone()

    result = run_capture(model, sample, sink, device=device)
    assert result.names == list(tensors)  # names are unique: one entry per captured tensor
    return tensors


def snapshot(model) -> dict:
    """Everything bind/unbind could leave behind: attributes, hooks, parameter objects and values."""
    return {
        "attrs": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "forward_in_dict": [name for name, m in model.named_modules() if "forward" in m.__dict__],
        "hooks": {name: [len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                       "_backward_pre_hooks")] for name, m in model.named_modules()},
        "param_ids": {n: id(p) for n, p in model.named_parameters()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def same_snapshot(a: dict, b: dict) -> None:
    for key in ("attrs", "forward_in_dict", "hooks", "param_ids"):
        assert a[key] == b[key], key
    assert list(a["state"]) == list(b["state"])
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory):
    preset = get_preset("tiny")
    store = Store(str(tmp_path_factory.mktemp("binding") / "store"))
    checkpoint = write_synthetic_checkpoint(store, preset)
    models = {dt: load_model(store, checkpoint, dt, DEVICE) for dt in (torch.float32, torch.bfloat16)}
    return preset, models, build_sample(preset.config, preset.sample)


@pytest.fixture(scope="module")
def fp32_bound(tiny_env):
    """One unbound run, one run with every node bound (fp32), one after unbind, with snapshots around them."""
    _, models, sample = tiny_env
    model = models[torch.float32]
    fired: list[str] = []
    handle = model.transformer_blocks[1].register_forward_hook(lambda *a: fired.append("tb1"))
    try:
        with reproducible(DEVICE):
            before, snap_before = capture(model, sample), snapshot(model)
        with bind(model) as binding:
            bound_forward = type(model.transformer_blocks[0].__dict__.get("forward")).__name__
            state_while_bound = {k: v.clone() for k, v in model.state_dict().items()}
            bound = capture(model, sample)
        with reproducible(DEVICE):
            after, snap_after = capture(model, sample), snapshot(model)
    finally:
        handle.remove()
    return dict(before=before, bound=bound, after=after, snap_before=snap_before, snap_after=snap_after,
                binding=binding, fired=fired, bound_forward=bound_forward, state_while_bound=state_while_bound)


# ------------------------------------------------------------------------------------------------ names


def test_node_names_groups_and_tables():
    assert len(BLOCK_NODES) == 12 and len(REFINER_NODES) == 11 and BOUNDARY_NODES == ("refiner_final_norm",
                                                                                      "norm_out")
    assert ALL_NODES == BLOCK_NODES + REFINER_NODES + BOUNDARY_NODES
    grouped = [n for nodes in NODE_GROUPS.values() for n in nodes]
    assert sorted(grouped) == sorted(ALL_NODES), "every node in exactly one group"
    assert set(CANDIDATE_OPS) == set(REFERENCE_OPS) == set(ALL_NODES)


# ------------------------------------------------------------------------------------------------ the chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_chain_is_diffusers_bit_for_bit(tiny_env, dtype):
    """nodes=() runs every block, refiner block, norm_out and final norm as the chain with reference ops only."""
    _, models, sample = tiny_env
    model = models[dtype]
    truth = capture(model, sample)
    with bind(model, nodes=()) as binding:
        chain = capture(model, sample)
    assert binding.ledger == {} and binding.missing() == []
    assert list(chain) == list(truth)  # same tensors in the same execution order
    # Forward bit-for-bit everywhere; gradients too on the CPU (CUDA's index_add / SDPA backward use atomics).
    names = [n for n in truth if DEVICE.type == "cpu" or n.startswith(("out/", "fwd/"))]
    different = [n for n in names if not torch.equal(chain[n], truth[n])]
    assert not different, f"{len(different)} tensors differ from diffusers, e.g. {different[:5]}"


def test_observer_sees_every_node_in_execution_order(tiny_env):
    _, models, sample = tiny_env
    model = models[torch.float32]
    seen: list[tuple[str, str, tuple, object]] = []
    with bind(model, nodes=(), observer=lambda b, n, args, out: seen.append((b, n, args, out))), torch.no_grad():
        model(**model_inputs(sample, DEVICE))
    expected = [(b, n) for b in TINY_REFINERS for n in REFINER_NODES]
    expected += [("token_refiner.final_norm", "refiner_final_norm")]
    expected += [(b, n) for b in TINY_BLOCKS for n in BLOCK_NODES] + [("norm_out", "norm_out")]
    assert [(b, n) for b, n, _, _ in seen] == expected
    # The chain hands each node's output on as is: norm1's output is the qkv input, the table reaches the residual.
    by = {(b, n): (args, out) for b, n, args, out in seen}
    block = "transformer_blocks.1"
    assert by[(block, "qkv")][0][0] is by[(block, "norm1_modulate")][1]
    assert by[(block, "gate_residual_attn")][0][2] is by[(block, "adaln_proj")][1]
    assert by[(block, "ff_out")][0][0] is by[(block, "swiglu")][1]
    assert by[(block, "adaln_proj")][0][1] is model.transformer_blocks[1].adaln_proj.linear.weight  # no copies


# ------------------------------------------------------------------------------------------------ bound, fp32


def test_bound_fp32_matches_diffusers(fp32_bound):
    before, bound = fp32_bound["before"], fp32_bound["bound"]
    # The forward runs in the same order; the backward's order is the candidate's own (its fused backward hands
    # norm_out its weight gradient before its bias gradient, for instance).
    assert sorted(bound) == sorted(before)
    assert [n for n in bound if n.startswith(("fwd/", "out/"))] == [n for n in before if n.startswith(("fwd/", "out/"))]
    errors = {n: rel_l2(bound[n], before[n]) for n in before}
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP32_REL, f"{worst}: rel-L2 {errors[worst]:.3e}"
    assert sum(n.startswith("grad/") for n in errors) == 74  # every parameter gradient, compared


def test_ledger_complete_after_forward_backward(fp32_bound):
    binding = fp32_bound["binding"]
    ledger = binding.ledger
    assert list(ledger) == TINY_REFINERS + ["token_refiner.final_norm"] + TINY_BLOCKS + ["norm_out"]
    for block in TINY_BLOCKS:
        assert list(ledger[block]) == list(BLOCK_NODES)
    for block in TINY_REFINERS:
        assert list(ledger[block]) == list(REFINER_NODES)
    entries = [e for nodes in ledger.values() for e in nodes.values()]
    assert len(entries) == 3 * 12 + 2 * 11 + 2
    assert all(e == {"forward": 1, "backward": 1, "fallback": None} for e in entries), ledger
    assert binding.missing() == []


def test_unbind_restores_exactly(fp32_bound, tiny_env):
    r = fp32_bound
    assert r["bound_forward"] == "_BoundForward" and r["fired"] == ["tb1", "tb1", "tb1"]  # hooks fired while bound
    same_snapshot(r["snap_before"], r["snap_after"])
    state = r["snap_before"]["state"]
    assert all(torch.equal(state[k], v) for k, v in r["state_while_bound"].items())  # bound: state_dict unchanged
    different = [n for n in r["before"] if not torch.equal(r["before"][n], r["after"][n])]
    assert not different, f"outputs after unbind differ: {different[:5]}"
    # unbind(model), Binding.unbind() and a second unbind are all the same, complete restoration.
    model = tiny_env[1][torch.float32]
    snap = snapshot(model)
    binding = bind(model, blocks={"norm_out"})
    assert "forward" in model.norm_out.__dict__
    unbind(model)
    unbind(model)
    binding.unbind()
    same_snapshot(snap, snapshot(model))


def test_describe_identifies_the_candidate(fp32_bound):
    d = fp32_bound["binding"].describe()
    assert set(d) == {"nodes", "blocks", "strict", "overrides", "torch", "triton", "h3kernels_sha256",
                      "h3kernels_files"}
    assert d["nodes"] == list(ALL_NODES) and d["strict"] is True and d["overrides"] == []
    assert d["blocks"]["transformer_blocks.2"] == list(BLOCK_NODES)
    assert d["torch"] == torch.__version__ and len(d["h3kernels_sha256"]) == 64
    assert {"binding.py", "nodes.py", "attention.py", "norm.py"} <= set(d["h3kernels_files"])


# ------------------------------------------------------------------------------------------------ bound, bf16


def _bf16_vs_fp32(models, sample, device, adaln_ratio: float) -> None:
    from tasks.providers import activate, needs_own_process, provider_set

    truth = capture(models[torch.float32], sample, device)
    # As the gate judges: against the worst of diffusers' BF16 providers on each tensor, not one draw of
    # rounding (a single provider's error on one tensor of a tiny model is itself a random variable). The
    # providers that need a process of their own (ATen's scalar kernels on a host without AVX-512) are left out.
    diffusers_error: dict[str, float] = {}
    for provider in (p for p in provider_set(device).values() if not needs_own_process(p)):
        with activate(provider, device):
            run = capture(models[torch.bfloat16], sample, device)
        for n in truth:
            diffusers_error[n] = max(diffusers_error.get(n, 0.0), rel_l2(run[n], truth[n]))
    with bind(models[torch.bfloat16]) as binding:
        bound = capture(models[torch.bfloat16], sample, device)
    assert binding.missing() == []
    ratios = {n: rel_l2(bound[n], truth[n]) / max(diffusers_error[n], 1e-12) for n in truth}
    for name in ("out/sample", "out/audio_sample"):
        assert ratios[name] <= 1.0, f"{name}: bound bf16 is {ratios[name]:.2f}x diffusers' bf16 error"
    adaln = {n: f"{ratios[n]:.2f}x" for n in truth if n.startswith("grad/") and "adaln_proj.linear.weight" in n}
    assert len(adaln) >= 3
    assert all(ratios[n] <= adaln_ratio for n in adaln), f"adaln_proj weight gradients (bound {adaln_ratio}x): {adaln}"
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= BF16_ANY_RATIO, f"{worst}: {ratios[worst]:.2f}x diffusers' bf16 error"


def test_bound_bf16_no_worse_than_diffusers(tiny_env):
    _, models, sample = tiny_env
    _bf16_vs_fp32(models, sample, DEVICE, ADALN_RATIO["tiny"])


# ------------------------------------------------------------------------------------------------ fallback


def _model(preset, dtype=torch.float32, **overrides):
    from diffusers import MiniMaxH3Transformer3DModel

    from tasks.model import synthetic_state_dict

    preset = get_preset(preset, overrides)
    model = MiniMaxH3Transformer3DModel(**preset.config)
    model.load_state_dict(synthetic_state_dict(preset.config, preset.weight_seed))
    return model.to(DEVICE, dtype).eval(), build_sample(preset.config, preset.sample)


def test_strict_fallback_names_block_node_and_reason():
    model, sample = _model("tiny", torch.float16)
    with bind(model), pytest.raises(NodeFallback, match=r"token_refiner\.refiner_blocks\.0/refiner_norm1: .*float16"):
        capture(model, sample)
    model, sample = _model("tiny", attention_head_dim=48)
    with bind(model), pytest.raises(NodeFallback, match=r"refiner_blocks\.0/refiner_attention: .*head dim 48"):
        capture(model, sample)


def test_non_strict_records_the_fallback_and_runs_the_reference():
    model, sample = _model("tiny", attention_head_dim=48)
    truth = capture(model, sample)
    with bind(model, nodes=NODE_GROUPS["attention"], strict=False) as binding:
        fell_back = capture(model, sample)
    assert all(torch.equal(fell_back[n], truth[n]) for n in truth if n.startswith(("out/", "fwd/")))
    entries = [e for nodes in binding.ledger.values() for e in nodes.values()]
    assert len(entries) == 5
    assert all(e["forward"] == e["backward"] == 0 and "head dim 48" in e["fallback"] for e in entries)
    assert binding.missing() == [f"{b}/refiner_attention" for b in TINY_REFINERS] + [
        f"{b}/attention" for b in TINY_BLOCKS]


# ------------------------------------------------------------------------------------------------ overrides, missing


def _block_outputs(model, sample) -> dict[str, torch.Tensor]:
    return {n.removeprefix("fwd/"): t for n, t in capture(model, sample).items() if n.startswith("fwd/")}


def test_override_changes_exactly_one_block_node(tiny_env):
    _, models, sample = tiny_env
    model = models[torch.float32]
    truth = _block_outputs(model, sample)

    def doubled_scale(q, k, v, backend, parallel_config):  # a softmax-scale mutant
        return REFERENCE_OPS["attention"](q * 2.0, k, v, backend, parallel_config)

    key = ("transformer_blocks.1", "attention")
    with bind(model, nodes=("attention",), blocks={key[0]}, overrides={key: REFERENCE_OPS["attention"]}):
        identity = _block_outputs(model, sample)
    with bind(model, nodes=("attention",), blocks={key[0]}, overrides={key: doubled_scale}) as binding:
        mutant = _block_outputs(model, sample)
    assert all(torch.equal(identity[n], truth[n]) for n in truth)
    order = list(truth)  # execution order: everything before transformer_blocks.1 is upstream of the mutant
    same = [n for n in order if torch.equal(mutant[n], truth[n])]
    assert same == order[:order.index(key[0])] and "transformer_blocks.0" in same
    assert binding.ledger == {key[0]: {"attention": {"forward": 1, "backward": 1, "fallback": None}}}
    assert binding.describe()["overrides"] == ["transformer_blocks.1/attention"]


def test_missing_names_bound_nodes_that_did_not_run(tiny_env):
    _, models, sample = tiny_env
    model = models[torch.float32]
    key = ("transformer_blocks.2", "swiglu")
    detached = {key: lambda proj: REFERENCE_OPS["swiglu"](proj).detach()}  # runs, but autograd never reaches it
    try:
        with bind(model, nodes=("swiglu",), overrides=detached) as binding:
            out = model(**model_inputs(sample, DEVICE))
            assert binding.missing() == [f"{b}/swiglu" for b in TINY_BLOCKS]  # forward only: no backward yet
            out.sample.float().sum().backward()
            assert binding.missing() == ["transformer_blocks.2/swiglu"]
            assert list(binding.ledger) == TINY_BLOCKS  # unbound nodes are not in the ledger, nor counted
            binding.reset_ledger()
            assert len(binding.missing()) == 3
    finally:
        model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------ bad inputs


def test_malformed_inputs_name_block_and_node(tiny_env):
    _, models, _ = tiny_env
    model = models[torch.float32]
    S, H = 8, 96
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, S, H, generator=g).to(DEVICE)
    temb = torch.randn(2, 48, generator=g).to(DEVICE)
    idx = torch.zeros(S, dtype=torch.long, device=DEVICE)
    rotary = model.rope(torch.zeros(S, 3, dtype=torch.long, device=DEVICE))
    block = model.transformer_blocks[0]
    where = r"transformer_blocks\.0/norm1_modulate: "
    with bind(model, blocks={"transformer_blocks.0"}):
        assert block(x, temb, idx, rotary).shape == (1, S, H)
        cases = [
            ((x, temb, idx + 6, rotary), r"outside the valid range \[0, 6\)"),
            ((x, temb, idx.float(), rotary), "dtype"),
            ((x, temb, idx.to("meta"), rotary), "mixed devices"),
            ((torch.randn(1, H, S).to(DEVICE).transpose(1, 2), temb, idx, rotary), "not contiguous"),
            ((x[:, :0], temb, idx[:0], rotary), "empty"),
        ]
        for args, message in cases:
            with pytest.raises(KernelInputError, match=where + ".*" + message):
                block(*args)
        with pytest.raises(ValueError, match="batch 1"):
            block(x.expand(2, S, H).contiguous(), temb, idx, rotary)


def test_bind_rejects_what_it_cannot_bind_exactly(tiny_env):
    _, models, _ = tiny_env
    model = models[torch.float32]
    with pytest.raises(ValueError, match="unknown nodes"):
        bind(model, nodes=("softmax",))
    with pytest.raises(ValueError, match="unknown blocks"):
        bind(model, blocks={"transformer_blocks.7"})
    with pytest.raises(ValueError, match="no bound"):
        bind(model, nodes=("swiglu",), overrides={("transformer_blocks.0", "attention"): REFERENCE_OPS["attention"]})
    with bind(model), pytest.raises(ValueError, match="already bound"):
        bind(model)
    snap = snapshot(model)
    model.norm_out.forward = model.norm_out.forward  # what accelerate's hooks do
    try:
        with pytest.raises(ValueError, match="instance forward"):
            bind(model)
    finally:
        del model.norm_out.forward
    same_snapshot(snap, snapshot(model))  # a rejected bind leaves nothing behind


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_small_preset_bf16_on_cuda(tmp_path):
    """At S=2056 the fp32 AdaLN table has diffusers' bf16 atomic scatter-add to beat (ADALN_RATIO['small'])."""
    spec = get_preset("small")
    store = Store(str(tmp_path / "store"))
    checkpoint = write_synthetic_checkpoint(store, spec)
    models = {dt: load_model(store, checkpoint, dt, "cuda") for dt in (torch.float32, torch.bfloat16)}
    sample = build_sample(spec.config, spec.sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _bf16_vs_fp32(models, sample, "cuda", ADALN_RATIO["small"])
        truth = capture(models[torch.bfloat16], sample, "cuda")
        with bind(models[torch.bfloat16], nodes=()):
            chain = capture(models[torch.bfloat16], sample, "cuda")
    forward = [n for n in truth if n.startswith(("out/", "fwd/"))]
    assert all(torch.equal(chain[n], truth[n]) for n in forward), "reference chain != diffusers on CUDA (forward)"
