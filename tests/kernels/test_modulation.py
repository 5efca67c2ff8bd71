"""adaln_table and segment_sum against float64 references, diffusers, and themselves."""

from __future__ import annotations

import pytest
import torch

from h3kernels import modulation, norm
from h3kernels import reference as ref
from h3kernels._common import KernelInputError, new_empty, poisoned_outputs
from tests.kernels.harness import (
    DEVICE,
    assert_close,
    assert_deterministic,
    assert_no_worse,
    gen,
    metrics,
    randint,
    randn,
    real,
    run,
    same_bytes,
)

# (T, E, H, K): timesteps, time_embed_dim, hidden, chunks per table row (6: block adaln_proj, C = 18H, rows 3T;
# 2: norm_out.linear, C = 2H, rows T).
ADALN_SHAPES = [
    pytest.param(1, 48, 96, 6, id="tiny"),
    pytest.param(3, 36, 72, 6, id="odd"),
    pytest.param(3, 48, 72, 2, id="odd-norm_out"),
    pytest.param(2, 256, 256, 6, id="mid"),
    real(3, 2688, 5376, 6, id="real"),
]
# (S, H, R): rows, hidden, table rows.
SEGMENT_SHAPES = [
    pytest.param(16, 96, 3, id="tiny"),
    pytest.param(37, 72, 9, id="odd"),
    pytest.param(1000, 256, 9, id="mid"),
    real(16384, 5376, 9, id="real"),
]


def adaln_args(T, E, H, K, wdtype, seed=0):
    g = gen(seed)
    C = 3 * K * H if K == 6 else K * H
    temb = randn(T, E, g=g, scale=2.0)  # fp32, as the checkpoint's time_embedder produces it
    weight = randn(C, E, g=g, dtype=wdtype, scale=E**-0.5)
    bias = randn(C, g=g, dtype=wdtype, scale=0.1)
    width = None if K == 6 else C
    rows = 3 * T if K == 6 else T
    return [temb, weight, bias, width], randn(rows, C * T // rows, g=g)


def segment_args(S, H, R, dtype, seed=0):
    g = gen(seed)
    return [randn(S, H, g=g, dtype=dtype), randint(R, S, g), R], randn(R, H, g=g)


# ------------------------------------------------------------------------------------ accuracy vs float64

@pytest.mark.parametrize("T,E,H,K", ADALN_SHAPES)
def test_adaln_table_fp32(T, E, H, K):
    args, dy = adaln_args(T, E, H, K, torch.float32)
    out, grads = run(modulation.adaln_table, args, (0, 1, 2), dy, poison=True)
    tout, tgrads = run(ref.adaln_table, args, (0, 1, 2), dy, cast=torch.float64)
    assert out.dtype == torch.float32
    assert_close("adaln_table", torch.float32, "out", out, tout)
    for name, c, t in zip(("temb", "weight", "bias"), grads, tgrads, strict=True):
        assert_close("adaln_table", torch.float32, f"grad:{name}", c, t)


@pytest.mark.parametrize("T,E,H,K", ADALN_SHAPES)
def test_adaln_table_bf16_weights_far_closer_than_diffusers(T, E, H, K):
    args, dy = adaln_args(T, E, H, K, torch.bfloat16)
    out, grads = run(modulation.adaln_table, args, (0, 1, 2), dy, poison=True)
    rout, rgrads = run(ref.adaln_table, args, (0, 1, 2), dy)
    tout, tgrads = run(ref.adaln_table, args, (0, 1, 2), dy, cast=torch.float64)
    assert out.dtype == torch.float32 and rout.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert_no_worse("adaln_table", torch.bfloat16, "out", out, rout, tout)
    for name, c, r, t in zip(("temb", "weight", "bias"), grads, rgrads, tgrads, strict=True):
        assert_no_worse("adaln_table", torch.bfloat16, f"grad:{name}", c, r, t)


@pytest.mark.parametrize("S,H,R", SEGMENT_SHAPES)
def test_segment_sum_fp32(S, H, R):
    args, dy = segment_args(S, H, R, torch.float32)
    out, grads = run(modulation.segment_sum, args, (0,), dy, poison=True)
    tout, tgrads = run(ref.segment_sum, args, (0,), dy, cast=torch.float64)
    assert_close("segment_sum", torch.float32, "out", out, tout)
    assert_close("segment_sum", torch.float32, "grad:values", grads[0], tgrads[0])


@pytest.mark.parametrize("S,H,R", SEGMENT_SHAPES)
def test_segment_sum_bf16_far_closer_than_diffusers(S, H, R):
    args, dy = segment_args(S, H, R, torch.bfloat16)
    out, grads = run(modulation.segment_sum, args, (0,), dy, poison=True)
    rout, rgrads = run(ref.segment_sum, args, (0,), dy)
    tout, tgrads = run(ref.segment_sum, args, (0,), dy, cast=torch.float64)
    assert out.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    assert_no_worse("segment_sum", torch.bfloat16, "out", out, rout, tout)
    assert_no_worse("segment_sum", torch.bfloat16, "grad:values", grads[0], rgrads[0], tgrads[0])


def test_segment_sum_empty_segments_are_zero():
    g = gen(4)
    values = randn(37, 72, g=g)
    idx = torch.where(randint(2, 37, g) == 0, 0, 4).to(DEVICE)
    out = modulation.segment_sum(values, idx, 9)
    assert torch.count_nonzero(out[[1, 2, 3, 5, 6, 7, 8]]) == 0
    assert_close("segment_sum", torch.float32, "out", out, ref.segment_sum(values.double(), idx, 9))


def test_adaln_fp32_table_rescues_the_weight_gradient():
    """The motivation: table grads scatter-added in bf16 (diffusers) vs reduced in fp32 end to end (candidate)."""
    T, E, H, S = 3, 48, 96, 4096
    (temb, weight, bias, _), _ = adaln_args(T, E, H, 6, torch.bfloat16, seed=2)
    g = gen(5)
    x, nw = randn(S, H, g=g, dtype=torch.bfloat16), randn(H, g=g, dtype=torch.bfloat16)
    dy = randn(S, H, g=g, dtype=torch.bfloat16)  # the upstream grad a bf16 block receives
    idx = randint(3 * T, S, g)

    def chain(adaln, rmsmod):
        def f(temb, weight, bias, x, nw):
            return rmsmod(x, nw, adaln(temb, weight, bias), idx, 0, 1, 1e-5)
        return f

    args = [temb, weight, bias, x, nw]
    _, cg = run(chain(modulation.adaln_table, norm.rms_norm_modulate), args, (0, 1), dy)
    _, rg = run(chain(ref.adaln_table, ref.rms_norm_modulate), args, (0, 1), dy)
    _, tg = run(chain(ref.adaln_table, ref.rms_norm_modulate), args, (0, 1), dy, cast=torch.float64)
    err = [(metrics(c, t)["rel_l2"], metrics(r, t)["rel_l2"]) for c, r, t in zip(cg, rg, tg, strict=True)]
    (ct, rt), (cw, rw) = err
    # Measured on the CPU (S=4096): d_temb candidate 2.4e-7 vs diffusers 2.8e-3; d_weight 1.7e-3 (its own bf16
    # rounding, a floor both paths share) vs 3.4e-3. On the GPU diffusers' scatter-add is atomic and worse.
    msg = f"d_temb: candidate {ct:.3e} diffusers {rt:.3e}; d_weight: candidate {cw:.3e} diffusers {rw:.3e}"
    assert cw < 0.8 * rw and ct < 0.05 * rt, msg


# ------------------------------------------------------------------------------- determinism, row independence

@pytest.mark.parametrize("T,E,H,K", [ADALN_SHAPES[1], ADALN_SHAPES[-1]])
def test_adaln_table_deterministic(T, E, H, K):
    args, dy = adaln_args(T, E, H, K, torch.bfloat16)
    assert_deterministic(modulation.adaln_table, args, (0, 1, 2), dy)


@pytest.mark.parametrize("S,H,R", [SEGMENT_SHAPES[2], SEGMENT_SHAPES[-1]])
def test_segment_sum_deterministic(S, H, R):
    args, dy = segment_args(S, H, R, torch.float32)
    assert_deterministic(modulation.segment_sum, args, (0,), dy)


def test_adaln_table_timesteps_independent():
    args, dy = adaln_args(3, 36, 72, 6, torch.bfloat16)
    out, (dtemb, _, _) = run(modulation.adaln_table, args, (0, 1, 2), dy)
    new, new_dy = list(args), dy.clone()
    new[0] = args[0].clone()
    new[0][[0, 2]] = randn(2, 36, g=gen(9))
    new_dy[[0, 1, 2, 6, 7, 8]] = randn(6, dy.shape[1], g=gen(10))  # table rows of timesteps 0 and 2
    out2, (dtemb2, _, _) = run(modulation.adaln_table, new, (0, 1, 2), new_dy)
    assert same_bytes(out[3:6], out2[3:6]) and same_bytes(dtemb[1], dtemb2[1])


# ------------------------------------------------------------------------------------------- validation

def test_poisoned_outputs_poison_every_buffer():
    with poisoned_outputs():
        assert torch.isnan(new_empty((3, 5), torch.bfloat16, DEVICE)).all()
        assert (new_empty((4,), torch.int64, DEVICE) == torch.iinfo(torch.int64).max).all()
    assert not torch.isnan(new_empty((2,), torch.float32, DEVICE).fill_(0)).any()


def test_adaln_table_rejects():
    (temb, w, b, _), _ = adaln_args(2, 16, 8, 6, torch.bfloat16)
    cases = [
        ((temb[:0], w, b), "`temb` is empty"),
        ((temb.half(), w, b), "`temb` has dtype torch.float16"),
        ((temb, w.t().contiguous().t(), b), "`weight` is not contiguous"),
        ((temb, w[:, :8].contiguous(), b), "`weight` has shape [144, 8], expected [-1, 16]"),
        ((temb, w, b[:10]), "`bias` has shape [10]"),
        ((temb, w, b, 100), "row width 100 does not divide"),
        ((temb.to("meta"), w, b), "mixed devices"),
        ((temb[0], w, b), "`temb` has shape [16]"),
    ]
    for call, match in cases:
        with pytest.raises(KernelInputError, match="adaln_table") as err:
            modulation.adaln_table(*call)
        assert match in str(err.value), str(err.value)


def test_segment_sum_rejects():
    (values, idx, _), _ = segment_args(8, 16, 3, torch.float32)
    cases = [
        ((values, idx, 0), "num_rows must be a positive int"),
        ((values, torch.full_like(idx, 3), 3), "outside the valid range [0, 3)"),
        ((values, idx - 5, 3), "outside the valid range [0, 3)"),
        ((values, idx.to(torch.int16), 3), "`idx` has dtype torch.int16"),
        ((values, idx[:4], 3), "`idx` has shape [4], expected [8]"),
        ((values.double(), idx, 3), "`values` has dtype torch.float64"),
        ((values.t(), idx, 3), "`values` is not contiguous"),
        ((values, idx.to("meta"), 3), "mixed devices"),
    ]
    for call, match in cases:
        with pytest.raises(KernelInputError, match="segment_sum") as err:
            modulation.segment_sum(*call)
        assert match in str(err.value), str(err.value)


# ------------------------------------------------------------------------- the references are diffusers'

@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_reference_adaln_table_matches_diffusers_bitwise():
    mt = pytest.importorskip("diffusers.models.transformers.transformer_minimax_h3")
    torch.manual_seed(0)
    mod = mt.MiniMaxH3AdaLayerNormModulation(time_embed_dim=48, hidden_size=96).to(torch.bfloat16)
    temb = torch.randn(3, 48)
    want = mod(temb)
    got = ref.adaln_table(temb, mod.linear.weight, mod.linear.bias).chunk(6, dim=-1)
    assert all(same_bytes(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_reference_segment_sum_is_index_select_backward():
    table = torch.randn(9, 72).to(torch.bfloat16).requires_grad_()
    idx, dy = torch.randint(0, 9, (37,)), torch.randn(37, 72).to(torch.bfloat16)
    (want,) = torch.autograd.grad(table.index_select(0, idx), table, dy)
    assert same_bytes(ref.segment_sum(dy, idx, 9), want)
