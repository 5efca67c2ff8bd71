"""gated_residual and residual_add against float64 references, diffusers, and themselves."""

from __future__ import annotations

import pytest
import torch

from h3kernels import reference as ref
from h3kernels import residual
from h3kernels._common import KernelInputError
from tests.kernels.harness import (
    DEVICE,
    assert_close,
    assert_deterministic,
    assert_no_worse,
    diffusers_block_capture,
    gen,
    randint,
    randn,
    real,
    run,
    same_bytes,
)

# (S, H, R): rows, hidden, table rows (3T).
SHAPES = [
    pytest.param(16, 96, 3, id="tiny"),
    pytest.param(37, 72, 9, id="odd"),
    pytest.param(256, 384, 6, id="mid"),
    real(4096, 5376, 9, id="real"),
]


def gated_args(S, H, R, dtype, seed=0, gate=5):
    g = gen(seed)
    x, branch = randn(S, H, g=g, dtype=dtype), randn(S, H, g=g, dtype=dtype)
    table = randn(R, 6 * H, g=g, scale=0.3)  # fp32, as modulation.adaln_table makes it
    return [x, branch, table, randint(R, S, g), gate], randn(S, H, g=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,H,R", SHAPES)
def test_gated_residual(S, H, R, dtype):
    args, dy = gated_args(S, H, R, dtype)
    out, grads = run(residual.gated_residual, args, (0, 1, 2), dy, poison=True)
    tout, tgrads = run(ref.gated_residual, args, (0, 1, 2), dy, cast=torch.float64)
    assert out.dtype == dtype and grads[2].dtype == torch.float32
    names = ("x", "branch", "table")
    if dtype == torch.float32:
        assert_close("gated_residual", dtype, "out", out, tout)
        for name, c, t in zip(names, grads, tgrads, strict=True):
            assert_close("gated_residual", dtype, f"grad:{name}", c, t)
    else:
        rout, rgrads = run(ref.gated_residual, args, (0, 1, 2), dy)
        assert_no_worse("gated_residual", dtype, "out", out, rout, tout)
        for name, c, r, t in zip(names, grads, rgrads, tgrads, strict=True):
            assert_no_worse("gated_residual", dtype, f"grad:{name}", c, r, t)
    other = [c for c in range(6) if c != 5]
    assert torch.count_nonzero(grads[2].view(R, 6, H)[:, other]) == 0, "a non-gate table chunk got a gradient"


def test_gated_residual_bf16_table_grad_in_table_dtype():
    args, dy = gated_args(37, 72, 9, torch.bfloat16, gate=2)
    args[2] = args[2].to(torch.bfloat16)
    _, (dt,) = run(residual.gated_residual, args, (2,), dy)
    _, (tt,) = run(ref.gated_residual, args, (2,), dy, cast=torch.float64)
    assert dt.dtype == torch.bfloat16
    # fp32 sums, one rounding to the bf16 table: within one bf16 rounding of float64.
    assert_close("gated_residual", torch.bfloat16, "grad:x", dt, tt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,H,R", SHAPES)
def test_residual_add(S, H, R, dtype):
    args, dy = gated_args(S, H, R, dtype)
    args = args[:2]
    out, grads = run(residual.residual_add, args, (0, 1), dy, poison=True)
    rout, rgrads = run(ref.residual_add, args, (0, 1), dy)
    # One addition with one rounding is exactly torch's add, in both dtypes.
    assert same_bytes(out, rout) and all(same_bytes(c, r) for c, r in zip(grads, rgrads, strict=True))
    tout, _ = run(ref.residual_add, args, (), cast=torch.float64)
    assert_close("residual_add", dtype, "out", out, tout)


def test_residual_add_any_shape():
    g = gen(3)
    x, b = randn(2, 5, 7, g=g, dtype=torch.bfloat16), randn(2, 5, 7, g=g, dtype=torch.bfloat16)
    assert same_bytes(residual.residual_add(x, b), x + b)


@pytest.mark.parametrize("S,H,R", [SHAPES[1], SHAPES[-1]])
def test_gated_residual_deterministic(S, H, R):
    args, dy = gated_args(S, H, R, torch.bfloat16)
    assert_deterministic(residual.gated_residual, args, (0, 1, 2), dy)


@pytest.mark.parametrize("S,H,R", [SHAPES[2], SHAPES[-1]])
def test_gated_residual_pipelined_backward_keeps_the_bytes(S, H, R, monkeypatch):
    # GATED_STAGES only changes how the one-table-row chunks' loads are issued (a pipelined tl.range on CUDA; the
    # interpreter ignores it): sorted table rows, so most chunks take that path, keep every gradient's bytes.
    args, dy = gated_args(S, H, R, torch.bfloat16, seed=3)
    args[3] = args[3].sort().values
    grads = []
    for stages in (1, 3):
        monkeypatch.setattr(residual, "GATED_STAGES", stages)
        grads.append(run(residual.gated_residual, args, (0, 1, 2), dy, poison=True)[1])
    assert all(same_bytes(a, b) for a, b in zip(grads[0], grads[1], strict=True))


def test_gated_residual_rows_independent():
    S, H, R = 37, 72, 9
    args, dy = gated_args(S, H, R, torch.bfloat16)
    keep = torch.tensor([0, 17, 36])
    out, (_, db, _) = run(residual.gated_residual, args, (0, 1, 2), dy)
    g = gen(11)
    new = list(args)
    for i in (0, 1):
        new[i] = randn(S, H, g=g, dtype=torch.bfloat16)
        new[i][keep] = args[i][keep]
    new[3] = randint(R, S, g)
    new[3][keep] = args[3][keep]
    dy2 = randn(S, H, g=g, dtype=torch.bfloat16)
    dy2[keep] = dy[keep]
    out2, (_, db2, _) = run(residual.gated_residual, new, (0, 1, 2), dy2)
    assert same_bytes(out[keep], out2[keep]) and same_bytes(db[keep], db2[keep])


def test_gated_residual_rejects():
    (x, b, t, idx, _), _ = gated_args(8, 16, 3, torch.float32)
    cases = [
        ((x, b.bfloat16(), t, idx, 2), "`branch` has dtype torch.bfloat16, `x` has torch.float32"),
        ((x, b[:4], t, idx, 2), "`branch` has shape [4, 16]"),
        ((x, b, t, idx, 6), "`gate_chunk` is 6"),
        ((x, b, t, idx, -1), "`gate_chunk` is -1"),
        ((x, b, t, torch.full_like(idx, 3), 2), "outside the valid range [0, 3)"),
        ((x, b, t[:, :40].contiguous(), idx, 2), "not a multiple of H=16"),
        ((x[:0], b[:0], t, idx[:0], 2), "`x` is empty"),
        ((x.t(), b.t(), t, idx, 2), "`x` is not contiguous"),
        ((x, b, t.to("meta"), idx, 2), "mixed devices"),
        ((x.half(), b.half(), t, idx, 2), "`x` has dtype torch.float16"),
    ]
    for call, match in cases:
        with pytest.raises(KernelInputError, match="gated_residual") as err:
            residual.gated_residual(*call)
        assert match in str(err.value), str(err.value)
    with pytest.raises(KernelInputError, match="residual_add: `branch` has shape"):
        residual.residual_add(x, b[:4])


@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_reference_gated_residual_matches_diffusers_block_bitwise():
    cap = diffusers_block_capture(seed=1)
    lin = cap["block"].adaln_proj.linear
    table = ref.adaln_table(cap["temb"], lin.weight, lin.bias)
    h1 = ref.gated_residual(cap["hidden"], cap["attn_out"], table, cap["idx"], 2)
    out = ref.gated_residual(h1, cap["ff_out"], table, cap["idx"], 5)
    assert same_bytes(out, cap["out"])
