"""rms_norm, rms_norm_modulate and qk_norm_rope against float64 references, diffusers, and themselves."""

from __future__ import annotations

import pytest
import torch

from h3kernels import _common, norm
from h3kernels import qk_norm_rope as qk_module
from h3kernels import reference as ref
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

EPS = 1e-5
# (S, H, T, K): rows, hidden, timesteps, chunks per table row (6: block table; 2: norm_out's [T, 2H] table).
NORM_SHAPES = [
    pytest.param(16, 96, 1, 6, id="tiny"),
    pytest.param(37, 72, 3, 6, id="odd"),
    pytest.param(29, 72, 3, 2, id="odd-norm_out"),
    pytest.param(256, 384, 2, 6, id="mid"),
    real(4096, 5376, 3, 6, id="real"),
]
# (S, NH, D, RD): rotary dim 0 = no rope (refiner blocks).
QK_SHAPES = [
    pytest.param(16, 4, 32, 24, id="tiny"),
    pytest.param(37, 3, 40, 18, id="odd"),
    pytest.param(21, 4, 32, 0, id="odd-norope"),
    pytest.param(128, 4, 64, 48, id="mid"),
    real(2048, 56, 128, 96, id="real"),
    real(2048, 56, 128, 0, id="real-norope"),
]


def modulate_args(S, H, T, K, dtype, seed=0):
    g = gen(seed)
    R = 3 * T if K == 6 else T
    x = randn(S, H, g=g, dtype=dtype)
    w = randn(H, g=g, dtype=dtype, scale=0.1, shift=1.0)
    table = randn(R, K * H, g=g, scale=0.3)  # fp32, as modulation.adaln_table makes it
    idx = randint(R, S, g)
    shift, scale = (3, 4) if K == 6 else (0, 1)
    return [x, w, table, idx, shift, scale, EPS], randn(S, H, g=g, dtype=dtype)


def qk_args(S, NH, D, RD, dtype, seed=0):
    g = gen(seed)
    x = randn(S, NH, D, g=g, dtype=dtype, scale=2.0)
    w = randn(D, g=g, dtype=dtype, scale=0.1, shift=1.0)
    cos = sin = None
    if RD:
        # As MiniMaxH3RotaryPosEmbed: angles concatenated with themselves; fp32 cos/sin of large angles.
        ang = randn(S, RD // 2, g=g, scale=30.0).repeat(1, 2)
        cos, sin = ang.cos(), ang.sin()
    return [x, w, cos, sin, EPS], randn(S, NH, D, g=g, dtype=dtype)


# ------------------------------------------------------------------------------------ accuracy vs float64

@pytest.mark.parametrize("S,H,T,K", NORM_SHAPES)
def test_rms_norm_modulate_fp32(S, H, T, K):
    args, dy = modulate_args(S, H, T, K, torch.float32)
    out, grads = run(norm.rms_norm_modulate, args, (0, 1, 2), dy, poison=True)
    tout, tgrads = run(ref.rms_norm_modulate, args, (0, 1, 2), dy, cast=torch.float64)
    assert_close("rms_norm_modulate", torch.float32, "out", out, tout)
    for name, c, t in zip(("x", "weight", "table"), grads, tgrads, strict=True):
        assert_close("rms_norm_modulate", torch.float32, f"grad:{name}", c, t)


@pytest.mark.parametrize("S,H,T,K", NORM_SHAPES)
def test_rms_norm_modulate_bf16_no_worse_than_diffusers(S, H, T, K):
    args, dy = modulate_args(S, H, T, K, torch.bfloat16)
    out, grads = run(norm.rms_norm_modulate, args, (0, 1, 2), dy, poison=True)
    rout, rgrads = run(ref.rms_norm_modulate, args, (0, 1, 2), dy)
    tout, tgrads = run(ref.rms_norm_modulate, args, (0, 1, 2), dy, cast=torch.float64)
    assert out.dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16 and grads[2].dtype == torch.float32
    assert_no_worse("rms_norm_modulate", torch.bfloat16, "out", out, rout, tout)
    for name, c, r, t in zip(("x", "weight", "table"), grads, rgrads, tgrads, strict=True):
        assert_no_worse("rms_norm_modulate", torch.bfloat16, f"grad:{name}", c, r, t)


def test_rms_norm_modulate_bf16_table_grad_in_table_dtype():
    args, dy = modulate_args(37, 72, 3, 6, torch.bfloat16)
    args[2] = args[2].to(torch.bfloat16)
    _, grads = run(norm.rms_norm_modulate, args, (2,), dy)
    assert grads[0].dtype == torch.bfloat16
    untouched = [c for c in range(6) if c not in (3, 4)]
    assert all(grads[0].view(-1, 6, 72)[:, c].abs().max() == 0 for c in untouched), "non shift/scale chunk written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,H,T,K", NORM_SHAPES)
def test_rms_norm(S, H, T, K, dtype):
    args, dy = modulate_args(S, H, T, K, dtype)
    args = [args[0], args[1], EPS]
    out, grads = run(norm.rms_norm, args, (0, 1), dy, poison=True)
    tout, tgrads = run(ref.rms_norm, args, (0, 1), dy, cast=torch.float64)
    if dtype == torch.float32:
        assert_close("rms_norm", dtype, "out", out, tout)
        for name, c, t in zip(("x", "weight"), grads, tgrads, strict=True):
            assert_close("rms_norm", dtype, f"grad:{name}", c, t)
    else:
        rout, rgrads = run(ref.rms_norm, args, (0, 1), dy)
        assert_no_worse("rms_norm", dtype, "out", out, rout, tout)
        for name, c, r, t in zip(("x", "weight"), grads, rgrads, tgrads, strict=True):
            assert_no_worse("rms_norm", dtype, f"grad:{name}", c, r, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,NH,D,RD", QK_SHAPES)
def test_qk_norm_rope(S, NH, D, RD, dtype):
    args, dy = qk_args(S, NH, D, RD, dtype)
    out, grads = run(norm.qk_norm_rope, args, (0, 1), dy, poison=True)
    tout, tgrads = run(ref.qk_norm_rope, args, (0, 1), dy, cast=torch.float64)
    if dtype == torch.float32:
        assert_close("qk_norm_rope", dtype, "out", out, tout)
        for name, c, t in zip(("x", "weight"), grads, tgrads, strict=True):
            assert_close("qk_norm_rope", dtype, f"grad:{name}", c, t)
    else:
        rout, rgrads = run(ref.qk_norm_rope, args, (0, 1), dy)
        assert_no_worse("qk_norm_rope", dtype, "out", out, rout, tout)
        for name, c, r, t in zip(("x", "weight"), grads, rgrads, tgrads, strict=True):
            assert_no_worse("qk_norm_rope", dtype, f"grad:{name}", c, r, t)


# Packed rows come in runs of one table row. These runs put one row chunk's rows in table rows 0, 1, 0 (a revisit:
# its partial row is added to, not overwritten), leave table rows untouched by whole chunks (their NaN-poisoned
# partials must never be read) and, at H=96 (16-row tiles), mix table rows inside tiles.
RUNS = [(0, 40), (1, 3), (0, 25), (2, 50), (1, 82)]
# Backward row chunks: the default (4 under the interpreter: runs cross chunk ends) and one chunk for all rows (every
# run and revisit inside it); each backward's prefetch choice flipped (its other loop); every split choice flipped
# (one block or two pieces per row).
NORM_SETTINGS = [
    pytest.param({}, id="default-chunks"),
    pytest.param(dict(NORM_BWD_CHUNKS=1), id="one-chunk"),
    pytest.param(dict(NORM_BWD_PREFETCH=1 - norm.NORM_BWD_PREFETCH), id="prefetch-flipped"),
    pytest.param({name: 1 - getattr(norm, name) for name in ("MODULATE_FWD_SPLIT", "RMS_NORM_FWD_SPLIT",
                                                              "MODULATE_BWD_SPLIT", "RMS_NORM_BWD_SPLIT")},
                 id="split-flipped"),
]
# At H=96 only: the finish's table rows per step (the main kernel's tiles do not change what the finish reads), two
# rows per step (R=3: the second step half masked) over two steps of chunks, and all rows in one step of every chunk;
# the runs kernel in tiles that straddle runs (at H=4100 it keeps the default kernel's bytes: the test below).
NARROW_SETTINGS = [
    pytest.param(96, dict(FINISH_BLOCK_R=2, FINISH_BLOCK_P=2, FINISH_BLOCK_H=32), id="tiles-of-16-finish-2-rows"),
    pytest.param(96, dict(FINISH_BLOCK_R=8, FINISH_BLOCK_P=256, FINISH_BLOCK_H=4), id="tiles-of-16-finish-all-rows"),
    pytest.param(96, dict(NORM_BWD_RUNS=1), id="tiles-of-16-runs-kernel"),
    pytest.param(96, dict(NORM_BWD_RUNS=1, NORM_BWD_CHUNKS=1), id="tiles-of-16-runs-kernel-one-chunk"),
]


@pytest.mark.parametrize("H,setting", [pytest.param(H, p.values[0], id=f"{name}-{p.id}")
                                       for H, name in ((96, "tiles-of-16"), (4100, "tiles-of-1"))
                                       for p in NORM_SETTINGS] + NARROW_SETTINGS)
def test_rms_norm_modulate_table_row_runs(H, setting, monkeypatch):
    for name, value in setting.items():
        monkeypatch.setattr(norm, name, value)
    args, dy = modulate_args(sum(n for _, n in RUNS), H, 1, 6, torch.float32, seed=4)
    args[3] = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in RUNS]).to(DEVICE)
    out, grads = run(norm.rms_norm_modulate, args, (0, 1, 2), dy, poison=True)
    tout, tgrads = run(ref.rms_norm_modulate, args, (0, 1, 2), dy, cast=torch.float64)
    assert_close("rms_norm_modulate", torch.float32, "out", out, tout)
    for name, c, t in zip(("x", "weight", "table"), grads, tgrads, strict=True):
        assert_close("rms_norm_modulate", torch.float32, f"grad:{name}", c, t)
    plain, pgrads = run(norm.rms_norm, [args[0], args[1], EPS], (0, 1), dy, poison=True)
    pout, ptgrads = run(ref.rms_norm, [args[0], args[1], EPS], (0, 1), dy, cast=torch.float64)
    assert_close("rms_norm", torch.float32, "out", plain, pout)
    for name, c, t in zip(("x", "weight"), pgrads, ptgrads, strict=True):
        assert_close("rms_norm", torch.float32, f"grad:{name}", c, t)


def _backward_grads(monkeypatch, H, knob, value, plain=True):
    """Gradients of rms_norm_modulate (then, with `plain`, of rms_norm) in bf16 with RUNS as the table rows, with
    norm.<knob> = value (poisoned outputs)."""
    monkeypatch.setattr(norm, knob, value)
    args, dy = modulate_args(sum(n for _, n in RUNS), H, 1, 6, torch.bfloat16, seed=5)
    args[3] = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in RUNS]).to(DEVICE)
    grads = run(norm.rms_norm_modulate, args, (0, 1, 2), dy, poison=True)[1]
    if plain:
        grads += run(norm.rms_norm, [args[0], args[1], EPS], (0, 1), dy, poison=True)[1]
    return grads


@pytest.mark.parametrize("H", [96, 4100], ids=["tiles-of-16", "tiles-of-1"])
def test_norm_backward_prefetch_keeps_the_bytes(H, monkeypatch):
    # The prefetch only moves where the loads are issued: every gradient of both norms keeps its bytes.
    grads = [_backward_grads(monkeypatch, H, "NORM_BWD_PREFETCH", prefetch) for prefetch in (0, 1)]
    assert all(same_bytes(a, b) for a, b in zip(grads[0], grads[1], strict=True))


@pytest.mark.parametrize("H", [96, 4100], ids=["tiles-of-16", "tiles-of-1"])
def test_norm_backward_runs_kernel_keeps_the_bytes(H, monkeypatch):
    # The runs kernel computes dx as the tile kernel does (the same factor, dot and rounding) and, in 1-row tiles,
    # the same partial sums in the same order: at H=4100 every gradient of the modulated norm keeps its bytes. In
    # 16-row tiles that mix table rows it sums a mixed tile's rows by run, not tile by tile, so there only dx (both
    # norms) and the plain norm's weight gradient (one run per chunk) must keep theirs; the float64 checks above
    # cover the rest.
    # The plain norm at 1-row tiles takes the modulated one's kernel path without the factor: H=96 only.
    grads = [_backward_grads(monkeypatch, H, "NORM_BWD_RUNS", runs, plain=H == 96) for runs in (0, 1)]
    kept = range(3) if H == 4100 else (0, 3, 4)  # dx, d_weight, d_table of the modulated norm; dx, d_weight plain
    assert all(same_bytes(grads[0][i], grads[1][i]) for i in kept)


# ------------------------------------------------------------------------------- determinism, row independence

@pytest.mark.parametrize("S,H,T,K", [NORM_SHAPES[1], NORM_SHAPES[-1]])
def test_rms_norm_modulate_deterministic(S, H, T, K):
    args, dy = modulate_args(S, H, T, K, torch.bfloat16)
    assert_deterministic(norm.rms_norm_modulate, args, (0, 1, 2), dy)


@pytest.mark.parametrize("S,NH,D,RD", [QK_SHAPES[1], QK_SHAPES[-2]])
def test_qk_norm_rope_deterministic(S, NH, D, RD):
    args, dy = qk_args(S, NH, D, RD, torch.bfloat16)
    assert_deterministic(norm.qk_norm_rope, args, (0, 1), dy)


def _other_rows_changed(args, dy, keep, seed, idx_pos=None, rows_of=(0,), R=None):
    """New random values (and table indices) on every row except `keep`."""
    g = gen(seed)
    new = list(args)
    for i in rows_of:
        fresh = randn(*args[i].shape, g=g, dtype=args[i].dtype)
        fresh[keep] = args[i][keep]
        new[i] = fresh
    if idx_pos is not None:
        fresh = randint(R, args[idx_pos].shape[0], g)
        fresh[keep] = args[idx_pos][keep]
        new[idx_pos] = fresh
    dy2 = randn(*dy.shape, g=g, dtype=dy.dtype)
    dy2[keep] = dy[keep]
    return new, dy2


def test_rms_norm_modulate_rows_independent():
    S, H, T, K = 37, 72, 3, 6
    args, dy = modulate_args(S, H, T, K, torch.bfloat16)
    keep = torch.tensor([0, 5, 36])
    out, (dx, *_) = run(norm.rms_norm_modulate, args, (0, 1, 2), dy)
    new, dy2 = _other_rows_changed(args, dy, keep, seed=7, idx_pos=3, R=3 * T)
    out2, (dx2, *_) = run(norm.rms_norm_modulate, new, (0, 1, 2), dy2)
    assert same_bytes(out[keep], out2[keep]) and same_bytes(dx[keep], dx2[keep])
    perm = torch.cat([keep, torch.tensor([i for i in range(S - 1, -1, -1) if i not in keep.tolist()])])
    pargs = list(args)
    pargs[0], pargs[3] = args[0][perm], args[3][perm]
    out3, (dx3, *_) = run(norm.rms_norm_modulate, pargs, (0, 1, 2), dy[perm])
    assert same_bytes(out[keep], out3[: len(keep)]) and same_bytes(dx[keep], dx3[: len(keep)])


def test_qk_norm_rope_rows_independent():
    S, NH, D, RD = 37, 3, 40, 18
    args, dy = qk_args(S, NH, D, RD, torch.bfloat16)
    keep = torch.tensor([1, 20, 36])
    out, (dx, _) = run(norm.qk_norm_rope, args, (0, 1), dy)
    new, dy2 = _other_rows_changed(args, dy, keep, seed=3, rows_of=(0, 2, 3))
    out2, (dx2, _) = run(norm.qk_norm_rope, new, (0, 1), dy2)
    assert same_bytes(out[keep], out2[keep]) and same_bytes(dx[keep], dx2[keep])


@pytest.mark.parametrize("RD", [24, 0], ids=["rope", "norope"])
def test_qk_norm_rope_backward_prefetch_keeps_the_bytes(RD, monkeypatch):
    # QK_BWD_PREFETCH only moves where the loads are issued (a tile ahead, past the last row masked): both
    # gradients keep their bytes. 37 x 4 rows in 4-row tiles: the last program's last tiles run past the end.
    S, NH, D = 37, 4, 32
    args, dy = qk_args(S, NH, D, RD, torch.bfloat16, seed=6)
    monkeypatch.setattr(qk_module, "QK_BWD_ROWS", 4)
    grads = {}
    for prefetch in (0, 1):
        monkeypatch.setattr(qk_module, "QK_BWD_PREFETCH", prefetch)
        grads[prefetch] = run(norm.qk_norm_rope, args, (0, 1), dy, poison=True)[1]
    assert all(same_bytes(a, b) for a, b in zip(grads[0], grads[1], strict=True))


@pytest.mark.parametrize("per_position,gather", [(1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("S,NH,D,RD", [QK_SHAPES[0], QK_SHAPES[1], QK_SHAPES[3], QK_SHAPES[-2]])
def test_qk_norm_rope_forward_variants_keep_the_bytes(S, NH, D, RD, per_position, gather, monkeypatch):
    # QK_FWD_PER_POSITION only changes which rows share a program (one position's heads, the cos/sin row loaded
    # once) and the tile's padding (NH=3 in 4-row tiles, 56 heads in 64 at the real width); QK_FWD_GATHER only
    # where the partner lanes come from (the tile itself, not a second load). The output and rstd keep their
    # bytes, and so does the backward, which reads rstd.
    args, dy = qk_args(S, NH, D, RD, torch.bfloat16, seed=8)
    runs = []
    for setting in ((0, 0), (per_position, gather)):
        monkeypatch.setattr(qk_module, "QK_FWD_PER_POSITION", setting[0])
        monkeypatch.setattr(qk_module, "QK_FWD_GATHER", setting[1])
        runs.append(run(norm.qk_norm_rope, args, (0, 1), dy, poison=True))
    (out0, grads0), (out1, grads1) = runs
    assert same_bytes(out0, out1)
    assert all(same_bytes(a, b) for a, b in zip(grads0, grads1, strict=True))


@pytest.mark.parametrize("prefetch,stages", [(0, 1), (1, 1), (0, 3)])
@pytest.mark.parametrize("S,NH,D,RD", [QK_SHAPES[0], QK_SHAPES[1], QK_SHAPES[3], QK_SHAPES[-2]])
def test_qk_norm_rope_backward_gather_keeps_the_bytes(S, NH, D, RD, prefetch, stages, monkeypatch):
    # QK_BWD_GATHER only changes where dy[p] sin[p] comes from (lane p of the tile's dy * sin, not a second load of
    # each), QK_BWD_STAGES how the loads are pipelined: both gradients keep the plain loop's bytes.
    args, dy = qk_args(S, NH, D, RD, torch.bfloat16, seed=9)
    grads = []
    for setting in ((0, 1, 0), (prefetch, stages, 0), (prefetch, stages, 1)):
        for name, value in zip(("QK_BWD_PREFETCH", "QK_BWD_STAGES", "QK_BWD_GATHER"), setting, strict=True):
            monkeypatch.setattr(qk_module, name, value)
        grads.append(run(norm.qk_norm_rope, args, (0, 1), dy, poison=True)[1])
    assert all(same_bytes(a, b) for other in grads[1:] for a, b in zip(grads[0], other, strict=True))


# ------------------------------------------------------------------------------------------- validation

def _bad_modulate_calls():
    args, _ = modulate_args(8, 16, 1, 6, torch.float32)
    x, w, t, idx = args[:4]
    meta = torch.empty(8, 16, device="meta")
    yield "empty", (x[:0], w, t, idx[:0], 3, 4, EPS), "is empty"
    yield "non-contiguous", (x.t().contiguous().t(), w, t, idx, 3, 4, EPS), "not contiguous"
    yield "mixed-devices", (meta, w, t, idx, 3, 4, EPS), "mixed devices"
    yield "float16", (x.half(), w, t, idx, 3, 4, EPS), "dtype torch.float16"
    yield "float64-table", (x, w, t.double(), idx, 3, 4, EPS), "`table` has dtype torch.float64"
    yield "float-idx", (x, w, t, idx.float(), 3, 4, EPS), "`idx` has dtype"
    yield "idx-high", (x, w, t, torch.full_like(idx, 3), 3, 4, EPS), "outside the valid range [0, 3)"
    yield "idx-negative", (x, w, t, idx - 1 - idx.max(), 3, 4, EPS), "outside the valid range"
    yield "idx-length", (x, w, t, idx[:5], 3, 4, EPS), "`idx` has shape [5]"
    yield "weight-shape", (x, w[:8], t, idx, 3, 4, EPS), "`weight` has shape [8]"
    yield "table-width", (x, w, t[:, :40].contiguous(), idx, 3, 4, EPS), "not a multiple of H=16"
    yield "chunk-range", (x, w, t, idx, 3, 6, EPS), "`scale_chunk` is 6"
    yield "chunk-equal", (x, w, t, idx, 3, 3, EPS), "both 3"
    yield "eps", (x, w, t, idx, 3, 4, -1.0), "eps"


@pytest.mark.parametrize("case,call,match", list(_bad_modulate_calls()), ids=[c[0] for c in _bad_modulate_calls()])
def test_rms_norm_modulate_rejects(case, call, match):
    with pytest.raises(KernelInputError, match="rms_norm_modulate") as err:
        norm.rms_norm_modulate(*call)
    assert match in str(err.value), str(err.value)


def test_index_range_is_read_once_per_tensor_version():
    # The range check's device read is remembered per tensor version (a block passes one index tensor to four ops):
    # the range is stored once, and an in-place write that puts an entry out of range is still caught.
    args, _ = modulate_args(8, 16, 1, 6, torch.float32)
    x, w, t, idx = args[:4]
    norm.rms_norm_modulate(*args)
    assert _common._INDEX_RANGES[idx][2:] == (int(idx.min()), int(idx.max()))
    norm.rms_norm_modulate(*args)
    idx[0] = t.shape[0]  # in place: bumps the version counter
    with pytest.raises(KernelInputError, match=r"outside the valid range \[0, 3\)"):
        norm.rms_norm_modulate(*args)
    with torch.inference_mode():  # inference tensors have no version counter: read every time, never stored
        frozen = idx.clone()
    assert _common.index_range(frozen) == (int(idx.min()), t.shape[0]) and frozen not in _common._INDEX_RANGES


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_repeated_index_check_does_not_sync_the_device():
    args, _ = modulate_args(64, 128, 2, 6, torch.bfloat16)
    norm.rms_norm_modulate(*args)  # the first call reads the range: one sync
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call now raises
    try:
        norm.rms_norm_modulate(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_rms_norm_and_qk_reject():
    x = randn(8, 16, g=gen(0))
    with pytest.raises(KernelInputError, match=r"rms_norm: `x` is not contiguous"):
        norm.rms_norm(x.t(), randn(8, g=gen(1)), EPS)
    with pytest.raises(KernelInputError, match=r"rms_norm: `x` has shape \[16\]"):
        norm.rms_norm(x[0], randn(16, g=gen(1)), EPS)
    (q, w, cos, sin, _), _ = qk_args(4, 2, 16, 8, torch.bfloat16)
    with pytest.raises(KernelInputError, match="qk_norm_rope: cos and sin"):
        norm.qk_norm_rope(q, w, cos, None, EPS)
    with pytest.raises(KernelInputError, match="qk_norm_rope: rotary dim 7"):
        norm.qk_norm_rope(q, w, cos[:, :7].contiguous(), sin[:, :7].contiguous(), EPS)
    with pytest.raises(KernelInputError, match=r"qk_norm_rope: `cos` has shape \[3, 8\]"):
        norm.qk_norm_rope(q, w, cos[:3], sin[:3], EPS)
    with pytest.raises(KernelInputError, match="qk_norm_rope: `x` has dtype torch.float64"):
        norm.qk_norm_rope(q.double(), w, cos, sin, EPS)


# ------------------------------------------------------------------------- the references are diffusers'

@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_references_match_diffusers_block_bitwise():
    cap = diffusers_block_capture()
    block, mt = cap["block"], cap["module"]
    lin = block.adaln_proj.linear
    table = ref.adaln_table(cap["temb"], lin.weight, lin.bias)
    attn_in = ref.rms_norm_modulate(cap["hidden"], block.norm1.weight, table, cap["idx"], 0, 1, block.norm1.eps)
    assert same_bytes(attn_in, cap["attn_in"])
    h1 = ref.gated_residual(cap["hidden"], cap["attn_out"], table, cap["idx"], 2)
    ff_in = ref.rms_norm_modulate(h1, block.norm2.weight, table, cap["idx"], 3, 4, block.norm2.eps)
    assert same_bytes(ff_in, cap["ff_in"])
    q = cap["q_in"]
    want = mt._apply_rotary_emb(block.attn.norm_q(q[None]), cap["cos"], cap["sin"])[0]
    got = ref.qk_norm_rope(q, block.attn.norm_q.weight, cap["cos"], cap["sin"], block.attn.norm_q.eps)
    assert same_bytes(got, want)
    assert same_bytes(ref.qk_norm_rope(q, block.attn.norm_q.weight, None, None, 1e-5), block.attn.norm_q(q))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="golden diffusers check runs on the CPU")
def test_reference_matches_diffusers_norm_out_bitwise():
    mt = pytest.importorskip("diffusers.models.transformers.transformer_minimax_h3")
    torch.manual_seed(1)
    mod = mt.MiniMaxH3AdaLayerNormOut(72, 48, eps=1e-5)
    with torch.no_grad():
        mod.norm.weight.copy_(1 + 0.1 * torch.randn(72))
    mod = mod.to(torch.bfloat16)
    h, temb, tidx = torch.randn(1, 29, 72).to(torch.bfloat16), torch.randn(3, 48), torch.randint(0, 3, (29,))
    want = mod(h, temb, tidx)[0]
    table = ref.adaln_table(temb, mod.linear.weight, mod.linear.bias, row_width=144)
    got = ref.rms_norm_modulate(h[0], mod.norm.weight, table, tidx, 0, 1, 1e-5)
    assert same_bytes(got, want)
