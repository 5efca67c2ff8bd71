"""swiglu against float64 references, diffusers' SwiGLU, and itself."""

from __future__ import annotations

import pytest
import torch

from h3kernels import reference as ref
from h3kernels import swiglu
from h3kernels._common import KernelInputError
from tests.kernels.harness import (
    DEVICE,
    assert_close,
    assert_deterministic,
    assert_no_worse,
    diffusers_block_capture,
    gen,
    randn,
    real,
    run,
    same_bytes,
)

# (S, F): rows, ffn dim (the projection is [S, 2F]).
SHAPES = [
    pytest.param(16, 256, id="tiny"),
    pytest.param(37, 100, id="odd"),
    pytest.param(256, 1024, id="mid"),
    real(4096, 14336, id="real"),
]


def swiglu_args(S, F, dtype, seed=0):
    g = gen(seed)
    # Gate pre-activations span the silu knee and both saturated tails.
    return [randn(S, 2 * F, g=g, dtype=dtype, scale=3.0)], randn(S, F, g=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,F", SHAPES)
def test_swiglu(S, F, dtype):
    args, dy = swiglu_args(S, F, dtype)
    out, (dp,) = run(swiglu.swiglu, args, (0,), dy, poison=True)
    tout, (tdp,) = run(ref.swiglu, args, (0,), dy, cast=torch.float64)
    assert out.dtype == dtype and dp.dtype == dtype and dp.shape == (S, 2 * F)
    if dtype == torch.float32:
        assert_close("swiglu", dtype, "out", out, tout)
        assert_close("swiglu", dtype, "grad:proj", dp, tdp)
    else:
        rout, (rdp,) = run(ref.swiglu, args, (0,), dy)
        assert_no_worse("swiglu", dtype, "out", out, rout, tout)
        assert_no_worse("swiglu", dtype, "grad:proj", dp, rdp, tdp)


def test_swiglu_extreme_gates_are_finite():
    proj = torch.tensor([[1.0, -2.0, 3.0, 200.0, -200.0, 0.0]], device=DEVICE)  # h = [1,-2,3], g = [200,-200,0]
    out, (dp,) = run(swiglu.swiglu, [proj], (0,), torch.ones(1, 3, device=DEVICE))
    assert torch.isfinite(out).all() and torch.isfinite(dp).all()
    assert out.tolist() == [[200.0, 0.0, 0.0]]


@pytest.mark.parametrize("S,F", [SHAPES[1], SHAPES[-1]])
def test_swiglu_deterministic(S, F):
    args, dy = swiglu_args(S, F, torch.bfloat16)
    assert_deterministic(swiglu.swiglu, args, (0,), dy)


def test_swiglu_rows_independent():
    args, dy = swiglu_args(37, 100, torch.bfloat16)
    keep = torch.tensor([2, 30])
    out, (dp,) = run(swiglu.swiglu, args, (0,), dy)
    g = gen(5)
    proj2, dy2 = randn(37, 200, g=g, dtype=torch.bfloat16), randn(37, 100, g=g, dtype=torch.bfloat16)
    proj2[keep], dy2[keep] = args[0][keep], dy[keep]
    out2, (dp2,) = run(swiglu.swiglu, [proj2], (0,), dy2)
    assert same_bytes(out[keep], out2[keep]) and same_bytes(dp[keep], dp2[keep])


def test_swiglu_rejects():
    (proj,), _ = swiglu_args(8, 16, torch.float32)
    cases = [
        (proj[:, :31].contiguous(), "last dim 31 is odd"),
        (proj[:, ::2], "`proj` is not contiguous"),
        (proj[:0], "`proj` is empty"),
        (proj.half(), "`proj` has dtype torch.float16"),
        (proj[0], "`proj` has shape [32]"),
    ]
    for call, match in cases:
        with pytest.raises(KernelInputError, match="swiglu") as err:
            swiglu.swiglu(call)
        assert match in str(err.value), str(err.value)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_reference_swiglu_matches_diffusers_bitwise():
    cap = diffusers_block_capture(seed=2)
    assert same_bytes(ref.swiglu(cap["swiglu_proj"]), cap["swiglu_out"])
