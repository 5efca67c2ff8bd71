"""The segmented row sums behind segment_sum's output and gated_residual's table gradient, on index layouts that
steer them down each path (see modulation.py: uniform chunk, uniform tile, mixed tile, tail). rms_norm_modulate's
backward sums its table rows in runs of its own (norm.py; tests/kernels/test_norm.py tests the runs); here it meets
the same layouts against float64 and reruns only.

The layouts are built from each op's plan (`plan_segments`, or `residual.bwd_plan`), so they hit the intended paths
at the interpreter's plan (S=1100: 4 chunks of 288 rows, not a power of two, in tiles of 32; the last chunk has 236
rows, its last tile 12) and at the GPU's default (35 chunks of 32 rows in tiles of 16, the last 12 rows). Which
path ran is seen only through results: a uniform tile must give the same bits as the masked sums, a uniform chunk
sums in another order.
"""

from __future__ import annotations

import pytest
import torch

from h3kernels import modulation, norm, residual
from h3kernels import reference as ref
from tests.kernels.harness import DEVICE, assert_close, gen, randint, randn, run, same_bytes

S, H, R = 1100, 72, 9
EPS = 1e-5
OPS = ["segment_sum", "rms_norm_modulate", "gated_residual"]
SEGMENTED_OPS = ["segment_sum", "gated_residual"]  # the ops whose sums follow their plan's chunks and tiles
LAYOUTS = ["one-row", "chunk-runs", "tile-runs", "long-runs", "random"]


def plan(op: str) -> tuple[int, int, int, int]:
    """(CHUNK_S, TILE_S, BLOCK_R, NC) of `op`'s segmented sums (rms_norm_modulate's layouts use segment_sum's)."""
    return residual.bwd_plan(S, R) if op == "gated_residual" else modulation.plan_segments(S, R)


def layout(name: str, op: str, seed: int = 0) -> torch.Tensor:
    """Table rows of the S sequence rows (int64), on `op`'s plan."""
    chunk, tile, _, _ = plan(op)
    s = torch.arange(S)
    if name == "one-row":  # every chunk uniform, the tail chunk too (in its rows < S)
        idx = torch.full((S,), 4)
    elif name == "chunk-runs":  # one table row per chunk, a different one in each; the last chunk is the tail
        idx = (s // chunk * 4 + 1) % R
    elif name == "tile-runs":  # runs of 3 tiles: mixed chunks whose full tiles are all uniform
        idx = (s // (3 * tile) * 2) % R
    elif name == "long-runs":  # runs of chunk + tile + 3 rows: uniform chunks, and mixed ones with one mixed tile
        idx = (s // (chunk + tile + 3) * 5 + 2) % R
    elif name == "random":  # every tile mixed
        idx = randint(R, S, gen(seed)).cpu()
    else:
        raise ValueError(name)
    return idx.to(DEVICE)


def inputs(op: str, idx: torch.Tensor, seed: int = 1):
    """(fn, reference fn, args, dy, grad_of) of `op` in fp32 with table-row indices idx."""
    g = gen(seed)
    if op == "segment_sum":
        return modulation.segment_sum, ref.segment_sum, [randn(S, H, g=g), idx, R], None, ()
    x = randn(S, H, g=g)
    if op == "rms_norm_modulate":
        w = randn(H, g=g, scale=0.1, shift=1.0)
        table = randn(R, 6 * H, g=g, scale=0.3)
        return norm.rms_norm_modulate, ref.rms_norm_modulate, [x, w, table, idx, 3, 4, EPS], randn(S, H, g=g), (0, 1, 2)
    branch, table = randn(S, H, g=g), randn(R, 6 * H, g=g, scale=0.3)
    return residual.gated_residual, ref.gated_residual, [x, branch, table, idx, 5], randn(S, H, g=g), (0, 1, 2)


def sums(op: str, out: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The results that come from the segmented sums (segment_sum's output, the weight and table grads)."""
    return {"segment_sum": [out], "rms_norm_modulate": grads[1:], "gated_residual": grads[2:]}[op]


def zero_row(op: str, args: list, dy: torch.Tensor | None, s0: int) -> None:
    """Make row s0 contribute exact zeros to every segmented sum (its values, or its upstream gradient)."""
    if op == "segment_sum":
        args[0][s0] = 0.0
    else:
        dy[s0] = 0.0


def moved(op: str, args: list, s0: int) -> list:
    """args with row s0 moved to table row 5 (a row that holds no other entry nearby)."""
    new = list(args)
    pos = 1 if op == "segment_sum" else 3
    new[pos] = args[pos].clone()
    new[pos][s0] = 5
    return new


def plan_with_tiles(op: str) -> tuple[int, int]:
    chunk, tile, _, nc = plan(op)
    if chunk < 2 * tile or nc < 3:
        pytest.skip(f"plan chunk={chunk} tile={tile} nc={nc}: needs chunks of several tiles")
    return chunk, tile


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_layouts_against_float64_and_reruns(op, name):
    chunk, _, _, nc = plan(op)
    assert nc >= 3 and S % chunk, "the shape must give several chunks and a partial tail chunk"
    fn, ref_fn, args, dy, grad_of = inputs(op, layout(name, op))
    out, grads = run(fn, args, grad_of, dy, poison=True)
    tout, tgrads = run(ref_fn, args, grad_of, dy, cast=torch.float64)
    assert_close(op, torch.float32, "out", out, tout)
    names = ("x", "weight" if op == "rms_norm_modulate" else "branch", "table")
    for i, c, t in zip(grad_of, grads, tgrads, strict=True):
        assert_close(op, torch.float32, f"grad:{names[i]}", c, t)
    out2, grads2 = run(fn, args, grad_of, dy)
    assert same_bytes(out, out2), f"{op} {name}: forward differs between two identical runs"
    for i, a, b in zip(grad_of, grads, grads2, strict=True):
        assert same_bytes(a, b), f"{op} {name}: gradient of arg {i} differs between two identical runs"


@pytest.mark.parametrize("op", SEGMENTED_OPS)
def test_uniform_tile_gives_the_masked_sums_bits(op):
    """A uniform tile (one sum) and the same tile made mixed by one zero row (R masked sums): the same bits."""
    chunk, tile = plan_with_tiles(op)
    idx = torch.full((S,), 2, device=DEVICE)
    idx[2 * chunk - tile:2 * chunk] = 7  # chunk 1 is mixed, so its tiles go one by one; its first tile is uniform
    s0 = chunk + 1  # in chunk 1's first tile; moving it to another table row makes that tile mixed
    fn, _, args, dy, grad_of = inputs(op, idx)
    zero_row(op, args, dy, s0)
    want = sums(op, *run(fn, args, grad_of, dy))
    got = sums(op, *run(fn, moved(op, args, s0), grad_of, dy))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert same_bytes(a, b), f"{op}: sum {i} of the uniform tile differs from its masked sums"


@pytest.mark.parametrize("op", SEGMENTED_OPS)
def test_uniform_chunk_is_summed_in_its_own_order(op):
    """A uniform chunk vs the same chunk made mixed by one zero row: equal in exact arithmetic, both close to
    float64, but not the same bits (the running-tile order is not the tile-by-tile order), which shows the uniform
    chunk took its own path."""
    chunk, _ = plan_with_tiles(op)
    idx = torch.full((S,), 2, device=DEVICE)
    s0 = chunk + 1  # moving it to another table row makes chunk 1 mixed
    fn, ref_fn, args, dy, grad_of = inputs(op, idx)
    zero_row(op, args, dy, s0)
    results = []
    for a in (args, moved(op, args, s0)):
        got = sums(op, *run(fn, a, grad_of, dy))
        truth = sums(op, *run(ref_fn, a, grad_of, dy, cast=torch.float64))
        for c, t in zip(got, truth, strict=True):
            assert_close(op, torch.float32, "grad:table" if op != "segment_sum" else "out", c, t)
        results.append(got)
    assert not all(same_bytes(a, b) for a, b in zip(*results, strict=True)), (
        f"{op}: the uniform chunk summed in the tile-by-tile order (its fast path did not run?)")
