"""h3kernels.attention against a float64 reference, forward and backward, on the CPU interpreter and the GPU.

Without CUDA the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py). The interpreter's bf16 arithmetic
is broken (it computes on raw uint16 bits), so there the kernels upcast loaded bf16 tiles to fp32 before tl.dot (the
UPCAST switch) while still rounding p, dS and outputs to bf16 where the GPU does: the bf16 results here model the
GPU's rounding, not its tensor-core summation order. With CUDA the same small cases run compiled on the GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3kernels import attention as A
from h3kernels._common import KernelInputError, is_interpreting, poisoned_outputs

DEVICE = "cpu" if is_interpreting() else "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclasses.dataclass(frozen=True)
class Tol:
    atol: float  # in units of the tensor's largest reference magnitude (of all three gradients where that is 0)
    rtol: float
    vs_torch: float | None  # max ratio of our Frobenius error to torch's bf16 SDPA error, both against the reference
    why: str


TOLERANCES: dict[tuple[str, torch.dtype, str], Tol] = {
    ("attention", torch.float32, "output"): Tol(
        1e-6, 1e-5, None, "fp32 accumulators and IEEE fp32 dots: only summation order differs (measured ~3e-7)"),
    ("attention", torch.float32, "grad"): Tol(
        2e-6, 2e-5, None, "as the output, plus the cancellation dP - delta in dS (measured ~3e-7)"),
    ("attention", torch.bfloat16, "output"): Tol(
        2**-7, 2**-8, 1.5, "p rounded to bf16 before P@V as flash attention does; torch's math path rounds once "
        "(measured ratio 1.2-1.3); atol = one bf16 ulp of the largest |o|"),
    ("attention", torch.bfloat16, "grad"): Tol(
        2**-7, 2**-8, 1.75, "p and dS rounded to bf16 before their dots (measured ratio 1.4-1.6)"),
    # Scores ~ +-100 (test_peaked_scores): every fp32 rounding of a score moves p by ~1e-5 relative, and FA2 rounds
    # scores more often than torch's math path (scale folded in, base 2, P recomputed from the saved logsumexp), so
    # the bounds follow the conditioning. A missing max-subtraction gives inf/NaN and a wrong rescale O(1) errors.
    # fp32 atol: torch's own max error reaches 1.8e-5 of max|o| at scores ~ -160; dq's 3x cancellation gives 1.1e-4.
    ("attention", torch.float32, "output-peaked"): Tol(1e-4, 1e-4, 2.0, "measured <= 7e-6 relative, <= 0.9x torch"),
    ("attention", torch.float32, "grad-peaked"): Tol(
        3e-4, 1e-4, 8.0, "measured up to 8.5e-6 relative, 6.2x torch (dv: P recomputed from lse ~ 150)"),
    ("attention", torch.bfloat16, "output-peaked"): Tol(2**-7, 2**-8, 1.5, "measured 1.0x torch"),
    ("attention", torch.bfloat16, "grad-peaked"): Tol(
        2**-7, 2**-8, 4.0, "bf16 dS of near-one-hot rows cancels in dS K (measured 3.3x torch, up from 1.5x)"),
}

# (B, S, NH, D): the tiny preset width, odd tails (17, 100), an exact tile (64), a single token.
SHAPES = [(1, 1, 1, 32), (2, 17, 3, 64), (1, 64, 2, 32), (2, 100, 1, 64)]
# 16-row tiles everywhere: many key/query tiles per row, so the online-softmax rescaling and tails really run.
SMALL_TILES = A.AttnConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, peak: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    return [x.to(dtype=dtype, device=DEVICE) for x in (q * peak, k, v, do)]


def _run(fn, q, k, v, do):  # noqa: ANN001, ANN202 (test helper over tensors)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


def _candidate(q, k, v, do, config=None):  # noqa: ANN001, ANN202
    return _run(lambda a, b, c: A.attention(a, b, c, config=config), q, k, v, do)


def _float64(q, k, v, do):  # noqa: ANN001, ANN202
    return _run(A.attention_reference, *(x.double() for x in (q, k, v, do)))


def _check(names, got, ref, tol: Tol, baseline=None) -> list[str]:  # noqa: ANN001
    """Failures as messages: max abs, relative (Frobenius) error, mismatch count and NaN/Inf count, separately."""
    failures = []
    for i, (name, g, r) in enumerate(zip(names, got, ref, strict=True)):
        scale = float(r.abs().max()) or max(float(x.abs().max()) for x in ref)
        err = (g.double() - r).abs()
        nan, inf = int(g.isnan().sum()), int(g.isinf().sum())
        mism = int((err > tol.atol * scale + tol.rtol * r.abs()).sum()) if nan + inf == 0 else g.numel()
        rel = float(err.norm() / max(float(r.norm()), 1e-30))
        msg = (f"{name} {g.dtype}: max_abs={float(err.max()):.3e} rel={rel:.3e} mismatches={mism}/{g.numel()} "
               f"(atol={tol.atol:.1e}*{scale:.2e}, rtol={tol.rtol:.1e}) nan={nan} inf={inf}")
        ok = mism == 0
        if tol.vs_torch is not None and baseline is not None:
            base = float((baseline[i].double() - r).norm())
            ok = ok and float(err.norm()) <= tol.vs_torch * base + tol.atol * scale
            msg += f" torch_rel={base / max(float(r.norm()), 1e-30):.3e} (limit x{tol.vs_torch})"
        if not ok:
            failures.append(msg)
    return failures


def _assert_close(got, ref, dtype: torch.dtype, baseline=None, case: str = "") -> None:  # noqa: ANN001
    fails = _check(["o"], got[:1], ref[:1], TOLERANCES[("attention", dtype, "output" + case)],
                   baseline and baseline[:1])
    fails += _check(["dq", "dk", "dv"], got[1:], ref[1:], TOLERANCES[("attention", dtype, "grad" + case)],
                    baseline and baseline[1:])
    assert not fails, "\n".join(fails)


def _bytes_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-S{}-NH{}-D{}".format(*s))
def test_forward_backward_match_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    q, k, v, do = _inputs(shape, dtype)
    baseline = _run(A.attention_reference, q, k, v, do) if dtype == torch.bfloat16 else None
    _assert_close(_candidate(q, k, v, do), _float64(q, k, v, do), dtype, baseline)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_tiles(dtype: torch.dtype) -> None:
    q, k, v, do = _inputs((1, 100, 2, 32), dtype, seed=1)
    baseline = _run(A.attention_reference, q, k, v, do) if dtype == torch.bfloat16 else None
    _assert_close(_candidate(q, k, v, do, SMALL_TILES), _float64(q, k, v, do), dtype, baseline)


@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["table", "small-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_peaked_scores(dtype: torch.dtype, config: A.AttnConfig | None) -> None:
    # q * 40: scaled scores have std 40, so a row max (~100) overflows exp() unless the running max is subtracted.
    q, k, v, do = _inputs((1, 100, 2, 32), dtype, seed=1, peak=40.0)
    baseline = _run(A.attention_reference, q, k, v, do)
    _assert_close(_candidate(q, k, v, do, config), _float64(q, k, v, do), dtype, baseline, "-peaked")


# numpy warns about the inf/NaN in dK/dV rows of tail keys, which the kernel computes but never stores.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2", "ignore:invalid value encountered in matmul")
def test_very_negative_scores() -> None:
    # Every score ~ -160 (base-2 logsumexp ~ -230): a tail key not masked out of the dQ kernel gets p = exp2(0 - lse)
    # = inf and turns dq into NaN. S=100 leaves a tail tile in every kernel. The common key component w cancels ~3x
    # in dS K, amplifying fp32 differences between the forward's and the dQ kernel's score sums (measured 3.4x torch
    # at the table's tiles, 1.2x when both use 16x16 tiles). fp32 only: in bf16 the same cancellation measures dS
    # rounding, not the mask.
    q, k, v, do = _inputs((1, 100, 2, 64), torch.float32, seed=10)
    w = torch.randn(64, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    k, q = w + 0.2 * k, -20.0 * w + 0.2 * q
    baseline = _run(A.attention_reference, q, k, v, do)
    _assert_close(_candidate(q, k, v, do), _float64(q, k, v, do), torch.float32, baseline, "-peaked")


@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["table", "small-tiles"])
def test_poisoned_outputs_are_fully_written(config: A.AttnConfig | None) -> None:
    q, k, v, do = _inputs((2, 100, 1, 64), torch.bfloat16, seed=2)
    clean = _candidate(q, k, v, do, config)
    with poisoned_outputs():  # every buffer the launchers allocate (o, lse, delta, dq, dk, dv) starts as NaN
        poisoned = _candidate(q, k, v, do, config)
    assert [int(t.isnan().sum()) for t in poisoned] == [0, 0, 0, 0]
    assert _bytes_equal(poisoned, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_byte_identical(dtype: torch.dtype) -> None:
    q, k, v, do = _inputs((2, 100, 1, 64), dtype, seed=3)
    assert _bytes_equal(_candidate(q, k, v, do), _candidate(q, k, v, do))


def test_dot_order_flags_do_not_change_results() -> None:
    # dkdv_dp_first / dq_dp_first only move where the dP dot is issued (a scheduling choice for the GPU); the
    # arithmetic is the same, so every combination must give the same bytes.
    q, k, v, do = _inputs((1, 100, 2, 32), torch.bfloat16, seed=3)
    runs = [_candidate(q, k, v, do, dataclasses.replace(SMALL_TILES, dkdv_dp_first=a, dq_dp_first=b))
            for a in (0, 1) for b in (0, 1)]
    assert all(_bytes_equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tma_loads_give_the_same_bytes(dtype: torch.dtype) -> None:
    # tma=1 reads the same tiles through tensor descriptors (tail rows zero-filled by the copy engine instead of a
    # mask): every output and gradient must be byte-identical to the pointer loads, tails and strided views included.
    q, k, v, do = _inputs((2, 100, 2, 32), dtype, seed=3)
    tma = dataclasses.replace(SMALL_TILES, fwd_tma=1, dkdv_tma=1, dq_tma=1)
    assert A._tma_ready(1, q, k, v, do)
    assert _bytes_equal(_candidate(q, k, v, do, tma), _candidate(q, k, v, do, SMALL_TILES))
    qkv = torch.stack([q, k, v], dim=2)  # [B, S, 3, NH, D] views, 16-byte strides: still descriptor loads
    assert A._tma_ready(1, qkv[:, :, 0], qkv[:, :, 2])
    assert _bytes_equal(_candidate(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], do, tma),
                        _candidate(q, k, v, do, SMALL_TILES))


def test_tma_needs_16_byte_alignment() -> None:
    # A view starting one element in is not 16-byte aligned: the launch takes the pointer loads, same bytes.
    q, k, v, do = _inputs((1, 17, 1, 32), torch.float32, seed=9)
    tma = dataclasses.replace(SMALL_TILES, fwd_tma=1, dkdv_tma=1, dq_tma=1)
    shifted = [torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape) for x in (q, k, v)]
    assert not A._tma_ready(1, *shifted) and not A._tma_ready(0, q, k, v)
    assert _bytes_equal(_candidate(*shifted, do, tma), _candidate(q, k, v, do, SMALL_TILES))


FUSED_SMALL = dataclasses.replace(SMALL_TILES, dq_fused=1)


def _assert_dq_agrees(fused: torch.Tensor, separate: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      do: torch.Tensor, cfg: A.AttnConfig) -> None:
    """Fused vs separate-kernel dq: one bf16 ulp (up to 2**-7 relative), plus the fixed point's documented error (half a
    unit per key block, unit = bound_i / 2**30 / sqrt(D)) and fp32-level noise of the bound (2**-20 of it, which
    covers both kernels' fp32 summation). Rows whose true dq is ~0 (S=1) are pure noise of that size."""
    S, D = k.shape[1], k.shape[-1]
    head_max = A._max_norm_products(k, v)[:, None, :, None]
    unit = 2 * torch.linalg.vector_norm(do.float(), dim=-1, keepdim=True) * head_max / A.DQ_FIX_ONE / D**0.5
    slack = unit * (-(-S // cfg.dkdv_n) + 1 + 2**10)
    diff = (fused.float() - separate.float()).abs()
    assert diff.le(2**-7 * torch.maximum(fused.float().abs(), separate.float().abs()) + slack).all(), (
        f"max diff {float(diff.max()):.3e}, max slack {float(slack.max()):.3e}")


@pytest.mark.parametrize("config", [FUSED_SMALL, None], ids=["small-tiles", "table"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-S{}-NH{}-D{}".format(*s))
def test_fused_dq_matches_float64_and_the_dq_kernel(shape: tuple[int, ...], config: A.AttnConfig | None) -> None:
    # dq_fused moves dQ's matmul into the dK/dV kernel and sums it in int32 fixed point: o, dk and dv must keep
    # their bytes, dq must meet the bf16 bounds and stay within one bf16 rounding of the dQ kernel's, and two runs
    # must give the same bytes although the integer atomics land in any order.
    q, k, v, do = _inputs(shape, torch.bfloat16, seed=12)
    fused = config or dataclasses.replace(A.CONFIGS[(shape[-1], torch.bfloat16)], dq_fused=1)
    separate = dataclasses.replace(fused, dq_fused=0)
    got, want = _candidate(q, k, v, do, fused), _candidate(q, k, v, do, separate)
    _assert_close(got, _float64(q, k, v, do), torch.bfloat16, _run(A.attention_reference, q, k, v, do))
    assert _bytes_equal([got[0], *got[2:]], [want[0], *want[2:]])
    _assert_dq_agrees(got[1], want[1], k, v, do, fused)
    assert _bytes_equal(got, _candidate(q, k, v, do, fused))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2", "ignore:invalid value encountered in")
def test_fused_dq_masks_tail_keys() -> None:
    # Scores ~ -160: a tail key (S=100 leaves one in every 16-key tile row) gets p = exp2(0 - lse) = inf, and its
    # k row of zeros would turn the dQ share into NaN (inf * 0) without the key mask the fused kernel applies.
    q, k, v, do = _inputs((1, 100, 2, 64), torch.bfloat16, seed=10)
    w = torch.randn(64, generator=torch.Generator().manual_seed(11)).to(DEVICE, torch.bfloat16)
    k, q = w + 0.2 * k, -20.0 * w + 0.2 * q
    got = _candidate(q, k, v, do, FUSED_SMALL)
    want = _candidate(q, k, v, do, SMALL_TILES)
    assert got[1].isfinite().all()
    _assert_dq_agrees(got[1], want[1], k, v, do, FUSED_SMALL)


@pytest.mark.filterwarnings("ignore:invalid value encountered in")
def test_fused_dq_zero_and_non_finite_rows() -> None:
    # A zero dO row has a zero bound, and its dq row must be exactly 0 (no 0/0); a NaN query row reaches dq only
    # through p, whose NaN the integer conversion would drop: the bound carries it, so that dq row is NaN as in torch.
    q, k, v, do = _inputs((1, 40, 2, 32), torch.bfloat16, seed=13)
    do[0, 3] = 0.0
    q[0, 5, 1] = float("nan")
    got = _candidate(q, k, v, do, FUSED_SMALL)
    assert got[1][0, 3, 0].eq(0).all() and got[1][0, 5, 1].isnan().all()
    assert got[1][0, 5, 0].isfinite().all()


def test_fused_dq_needs_bfloat16() -> None:
    q, k, v, _ = _inputs((1, 17, 1, 32), torch.float32)
    with pytest.raises(KernelInputError, match="dq_fused=1 needs bfloat16"):
        A.attention(q, k, v, config=FUSED_SMALL)


@pytest.mark.parametrize("config", [None, FUSED_SMALL], ids=["table", "fused-dq"])
def test_batch_items_are_independent(config: A.AttnConfig | None) -> None:
    # The second item's v and dO are 1e6 times larger: with fused dQ, a fixed-point unit taken from anything but the
    # item's own dO, k and v would be ~1e12 times too coarse for the first item's dq and round it to 0.
    q, k, v, do = _inputs((2, 17, 2, 32), torch.bfloat16, seed=4)
    both = _candidate(q, k, v, do, config)
    alone = _candidate(*(x[:1].clone() for x in (q, k, v, do)), config)
    other = [x * scale for x, scale in zip(_inputs((2, 17, 2, 32), torch.bfloat16, seed=5), (1, 1, 1e6, 1e6),
                                           strict=True)]
    changed = _candidate(*(torch.cat([x[:1], y[1:]]) for x, y in zip((q, k, v, do), other, strict=True)), config)
    assert _bytes_equal([t[:1] for t in both], alone)
    assert _bytes_equal([t[:1] for t in changed], alone)
    assert not torch.equal(changed[0][1:], both[0][1:])


def test_strided_layouts_read_without_copies() -> None:
    B, S, NH, D = 1, 17, 2, 32
    q, k, v, do = _inputs((B, S, NH, D), torch.float32, seed=6)
    want = _candidate(q, k, v, do)
    qkv = torch.stack([q, k, v], dim=2)  # [B, S, 3, NH, D]: q/k/v views of one fused projection
    assert not qkv[:, :, 0].is_contiguous()
    assert _bytes_equal(_candidate(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], do), want)
    bnsd = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]  # [B, NH, S, D] memory
    assert _bytes_equal(_candidate(*bnsd, do), want)


def test_expanded_grad_output() -> None:
    q, k, v, _ = _inputs((1, 17, 1, 32), torch.float32, seed=7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    A.attention(*leaves).sum().backward()  # autograd hands the backward a stride-0 expanded dO
    want = _candidate(q, k, v, torch.ones_like(q))
    assert _bytes_equal([x.grad for x in leaves], want[1:])


def test_config_override_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(A.CONFIG_ENV, "fwd_m=16, fwd_n=32,dq_n=16")
    cfg = A.resolve_config(32, torch.float32)
    assert (cfg.fwd_m, cfg.fwd_n, cfg.dq_n, cfg.dq_m) == (16, 32, 16, A.CONFIGS[(32, torch.float32)].dq_m)
    q, k, v, do = _inputs((1, 40, 1, 32), torch.float32, seed=8)
    assert _bytes_equal(_candidate(q, k, v, do), _candidate(q, k, v, do, cfg))
    for bad in ("fwd_m=48", "fwd_m=", "block=64", "fwd_warps=0", "dq_dp_first=2", "dq_tma=2"):
        with pytest.raises(KernelInputError, match="attention: "):
            A.resolve_config(32, torch.float32, bad)


@pytest.mark.skipif(not is_interpreting(), reason="the UPCAST switch exists for the CPU interpreter")
def test_interpreter_upcasts_bf16_tiles() -> None:
    # The interpreter's bf16 tl.dot returns ~1e10 garbage; the kernels must widen tiles to fp32 there.
    assert A._launch_flags(torch.bfloat16) == {"UPCAST": True, "PREC": "ieee"}


def _t(shape=(1, 8, 2, 32), dtype=torch.float32, device=DEVICE):  # noqa: ANN001, ANN202
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: (_t((1, 0, 2, 32)), _t((1, 0, 2, 32)), _t((1, 0, 2, 32))), "empty"),
    (lambda: (_t(), _t((1, 9, 2, 32)), _t()), "shapes differ"),
    (lambda: (_t(), _t(dtype=torch.bfloat16), _t()), "dtypes differ"),
    (lambda: (_t(), _t(device="meta"), _t()), "devices differ"),
    (lambda: (_t(dtype=torch.float64),) * 3, "float64 unsupported"),
    (lambda: (_t(dtype=torch.int32),) * 3, "int32 unsupported"),
    (lambda: (_t((1, 8, 2, 48)),) * 3, "D=48 unsupported"),
    (lambda: (_t((8, 2, 32)),) * 3, "must be [B, S, NH, D]"),
    (lambda: (_t((1, 8, 2, 64))[..., ::2],) * 3, "last dim must be contiguous"),
    (lambda: ([[0.0]], _t(), _t()), "must be a torch.Tensor"),
], ids=["empty", "shape", "dtype", "device", "fp64", "int", "head-dim", "ndim", "last-stride", "non-tensor"])
def test_rejects_bad_inputs(make, needle: str) -> None:  # noqa: ANN001
    with pytest.raises(KernelInputError, match=r"^attention: ") as info:
        A.attention(*make())
    assert isinstance(info.value, ValueError) and needle in str(info.value)


def test_rejects_cpu_tensors_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(A, "_INTERPRET", False)
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        A.attention(*(_t(device="cpu"),) * 3)


ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "attention.py"


def _nvidia_tools() -> bool:
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))


@pytest.mark.skipif(not _nvidia_tools(), reason="triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed")
def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    # The interpreter never runs the Triton compiler: this is the CPU machine's check that the GPU path compiles at
    # the table's launch constants, without register spills and within the H200's 227 KiB of shared memory per block.
    # bench/attention.py --compile-only is the one compile checker (the sweep's candidates are checked with it too);
    # it gives pointers and strides the 16-byte alignment hints real launches get, without which Triton does not
    # pipeline the tile loads and the register counts describe a kernel that never runs. A subprocess, because
    # TRITON_INTERPRET is fixed when the kernels are decorated.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, str(BENCH), "--compile-only", "--table", "--json"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = {f"{cfg} / {k}": v for cfg, kernels in json.loads(proc.stdout.strip().splitlines()[-1]).items()
              for k, v in kernels.items()}
    # delta + fwd/dkdv/dq with and without a tail tile per table entry; a dq_fused entry has a finish kernel instead
    # of the two dQ kernels
    assert len(report) == sum(6 if cfg.dq_fused else 7 for cfg in A.CONFIGS.values())
    assert not {k: v["error"] for k, v in report.items() if "error" in v}
    assert not {k: v for k, v in report.items() if v["stack"] or v["smem"] > 227 * 1024}, report


# The (128, bf16) table entry sessions 2 to 13 ran (session 2's backward sweep winner, pointer loads): the baseline
# the forward and TMA sweep files start from.
SESSION2_TABLE = A.AttnConfig(128, 64, 8, 3, 32, 128, 8, 4, 128, 64, 8, 4, 1, 1)


def _bench_module() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = sys.modules.setdefault("bench_attention", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(bench)
    return bench


def test_sweep_file_lines_are_valid_configs() -> None:
    # bench/attention_sweep.txt runs on the H200 in one call: a line that does not parse would only show up there.
    lines = _bench_module()._sweep_specs(str(ROOT / "bench" / "attention_sweep.txt"))
    assert 10 <= len(lines) <= 20 and len(set(lines)) == len(lines)
    configs = [A.resolve_config(128, torch.bfloat16, line) for line in lines]
    assert len(set(configs)) == len(configs)
    # the pre-sweep table comes first (the baseline of every sweep); session 2's winner is one of the lines
    assert configs[0] == A.AttnConfig(128, 64, 8, 3, 32, 64, 8, 3, 64, 64, 4, 3, 0, 0)
    assert SESSION2_TABLE in configs


def test_forward_sweep_file_varies_only_the_forward() -> None:
    # bench/attention_sweep_fwd.txt: distinct forward tiles over session 2's backward, that table entry first.
    lines = _bench_module()._sweep_specs(str(ROOT / "bench" / "attention_sweep_fwd.txt"))
    configs = [A.resolve_config(128, torch.bfloat16, line) for line in lines]
    assert len(lines) >= 5 and len(set(configs)) == len(configs)
    assert configs[0] == SESSION2_TABLE
    assert all(dataclasses.replace(c, **{f: getattr(SESSION2_TABLE, f) for f in _fields("fwd_")}) == SESSION2_TABLE
               for c in configs)


def test_tma_sweep_file_starts_at_the_old_table_and_ends_at_the_new() -> None:
    # bench/attention_sweep_tma.txt: the pointer-load table first (the baseline), the table it produced last.
    lines = _bench_module()._sweep_specs(str(ROOT / "bench" / "attention_sweep_tma.txt"))
    configs = [A.resolve_config(128, torch.bfloat16, line) for line in lines]
    assert len(lines) >= 5 and len(set(configs)) == len(configs)
    assert configs[0] == SESSION2_TABLE
    assert configs[-1] == A.CONFIGS[(128, torch.bfloat16)] != SESSION2_TABLE
    assert all(c.fwd_tma or c.dkdv_tma or c.dq_tma for c in configs[1:])


def _fields(prefix: str) -> list[str]:
    return [f.name for f in dataclasses.fields(A.AttnConfig) if f.name.startswith(prefix)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("S", "dtype"), [(1000, torch.bfloat16), (4096, torch.bfloat16), (4097, torch.bfloat16),
                                          (1000, torch.float32)], ids=["S1000", "S4096", "S4097", "S1000-fp32"])
def test_real_shape_on_gpu(S: int, dtype: torch.dtype) -> None:
    q, k, v, do = _inputs((1, S, 56, 128), dtype, seed=9)
    got = _candidate(q, k, v, do)
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    ref = _run(A.attention_reference, *(x.to(ref_dtype) for x in (q, k, v, do)))
    # bf16 baseline: torch's default SDPA (cuDNN / flash), which also rounds P to bf16 (the providers' level).
    sdpa = _run(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)).transpose(1, 2), q, k, v, do)
    _assert_close(got, [r.double() for r in ref], dtype, sdpa if dtype == torch.bfloat16 else None)
    assert _bytes_equal(got, _candidate(q, k, v, do)), "two runs differ"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("S", [4096, 4097], ids=["S4096", "S4097"])
def test_tma_loads_match_pointer_loads_on_gpu(S: int) -> None:
    # On the GPU the descriptor loads are real TMA copies (the interpreter emulates them): same bytes at the real
    # width, with and without a tail tile, in every kernel, at the table tiles and at the TMA sweep's larger ones.
    q, k, v, do = _inputs((1, S, 56, 128), torch.bfloat16, seed=10)
    table = A.CONFIGS[(128, torch.bfloat16)]
    for tiles in ({}, {"fwd_n": 128, "fwd_stages": 2, "dkdv_m": 64, "dkdv_n": 64}):
        pointer = dataclasses.replace(table, fwd_tma=0, dkdv_tma=0, dq_tma=0, **tiles)
        tma = dataclasses.replace(pointer, fwd_tma=1, dkdv_tma=1, dq_tma=1)
        assert _bytes_equal(_candidate(q, k, v, do, tma), _candidate(q, k, v, do, pointer)), tiles


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("S", [4096, 4097], ids=["S4096", "S4097"])
def test_fused_dq_on_gpu(S: int) -> None:
    # The fused dQ at the real width, with and without a tail tile: o, dk and dv byte-identical to the separate-dQ
    # kernels, dq within one bf16 rounding of theirs, and byte-identical run to run (the integer atomics' order
    # varies on the GPU).
    q, k, v, do = _inputs((1, S, 56, 128), torch.bfloat16, seed=11)
    table = A.CONFIGS[(128, torch.bfloat16)]
    for tiles in ({}, {"dkdv_m": 16}):
        fused = dataclasses.replace(table, dq_fused=1, **tiles)
        got, want = _candidate(q, k, v, do, fused), _candidate(q, k, v, do, dataclasses.replace(fused, dq_fused=0))
        assert _bytes_equal([got[0], *got[2:]], [want[0], *want[2:]]), tiles
        _assert_dq_agrees(got[1], want[1], k, v, do, fused)
        assert _bytes_equal(got, _candidate(q, k, v, do, fused)), tiles
