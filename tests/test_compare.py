"""tasks/compare.py: chunked float64 metrics against a direct float64 computation, and every rejection."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.compare import (
    ComparisonError,
    TensorComparison,
    canonical_json,
    compare_runs,
    compare_tensors,
    json_float,
    max_abs,
    parse_float,
    relative_l2,
)

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _direct(c: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """The unchunked float64 definition: (relative_l2, max_abs)."""
    d = c.double() - r.double()
    return (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(r.double())).item(), d.abs().max().item()


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 3001),
    chunk=st.integers(1, 4096),
    c_dtype=st.sampled_from(FLOAT_DTYPES),
    r_dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_equals_direct_float64(numel: int, chunk: int, c_dtype: torch.dtype, r_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(numel, generator=g).to(r_dtype)
    c = (r.double() + 1e-2 * torch.randn(numel, generator=g, dtype=torch.float64)).to(c_dtype)
    got = compare_tensors("t", c, r, chunk_elems=chunk)
    rel, mabs = _direct(c, r)
    assert math.isclose(got.relative_l2, rel, rel_tol=1e-12, abs_tol=0.0)
    assert got.max_abs == mabs  # a max does not depend on the chunking
    assert got.numel == numel and got.nonfinite == 0 and got.ref_nonfinite == 0
    assert math.isclose(got.diff_norm / got.ref_norm, got.relative_l2, rel_tol=1e-15)


def test_bf16_candidate_vs_fp32_reference_odd_shape():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(37, 129, 5, generator=g)  # odd, non power of two
    c = r.bfloat16()
    got = compare_tensors("out/sample", c, r, chunk_elems=1000)
    rel, mabs = _direct(c, r)
    assert math.isclose(got.relative_l2, rel, rel_tol=1e-12)
    assert got.max_abs == mabs
    assert 0 < got.relative_l2 < 2**-8  # bf16 rounding, below its unit roundoff
    assert relative_l2(c, r, chunk_elems=1000) == got.relative_l2
    assert max_abs(c, r) == got.max_abs


def test_non_contiguous_equals_contiguous():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(33, 17, generator=g)
    c = r + 1e-3 * torch.randn(33, 17, generator=g)
    assert compare_tensors("t", c.t(), r.t(), chunk_elems=10) == compare_tensors(
        "t", c.t().contiguous(), r.t().contiguous(), chunk_elems=10
    )


def test_float64_inputs_are_not_modified():
    c = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    r = torch.tensor([1.5, 2.0, 2.0], dtype=torch.float64)
    before = c.clone()
    compare_tensors("t", c, r, chunk_elems=2)
    assert torch.equal(c, before)


def test_shape_mismatch_names_tensor_and_shapes():
    with pytest.raises(ComparisonError, match=r"grad/blocks\.0\.w.*\(2, 3\).*\(3, 2\)"):
        compare_tensors("grad/blocks.0.w", torch.zeros(2, 3), torch.zeros(3, 2))
    assert issubclass(ComparisonError, ValueError)


def test_other_rejections():
    with pytest.raises(ComparisonError, match="dtype kind"):
        compare_tensors("t", torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ComparisonError, match="complex"):
        compare_tensors("t", torch.zeros(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ComparisonError, match="not a torch.Tensor"):
        compare_tensors("t", [1.0], torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_elems"):
        compare_tensors("t", torch.zeros(1), torch.zeros(1), chunk_elems=0)


def test_zero_norm_reference_uses_absolute_norm():
    c = torch.tensor([3.0, 4.0])
    got = compare_tensors("t", c, torch.zeros(2))
    assert got.ref_norm == 0.0 and got.diff_norm == 5.0 and got.relative_l2 == 5.0
    exact = compare_tensors("t", torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    assert exact.relative_l2 == 0.0 and exact.max_abs == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_candidate_is_infinite_error(bad: float):
    r = torch.ones(10)
    c = r.clone().bfloat16()
    c[3] = bad
    c[7] = bad
    got = compare_tensors("t", c, r, chunk_elems=4)
    assert got.nonfinite == 2 and got.ref_nonfinite == 0
    assert got.relative_l2 == math.inf and got.max_abs == math.inf and got.diff_norm == math.inf


def test_nonfinite_reference_is_infinite_error():
    r = torch.ones(5)
    r[0] = float("nan")
    got = compare_tensors("t", torch.ones(5), r)
    assert got.ref_nonfinite == 1 and got.nonfinite == 0 and got.relative_l2 == math.inf


def test_infinities_in_both_tensors_are_counted_in_each():
    r = torch.tensor([1.0, float("inf"), 2.0, float("-inf")])
    c = torch.tensor([1.0, float("inf"), float("nan"), 0.0], dtype=torch.bfloat16)
    got = compare_tensors("t", c, r, chunk_elems=3)
    assert (got.nonfinite, got.ref_nonfinite) == (2, 2) and got.relative_l2 == math.inf and got.ref_norm == math.inf


def test_float64_inputs_are_never_written_into():
    c = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    r = torch.tensor([1.5, -2.0, 2.0], dtype=torch.float64)
    before = (c.clone(), r.clone())
    assert compare_tensors("t", c, r).max_abs == 1.0
    assert torch.equal(c, before[0]) and torch.equal(r, before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_comparison_matches_the_direct_float64_definition():
    torch.manual_seed(0)
    r = torch.randn(3 * 2**20 + 7, device="cuda")
    c = (r * 1.001).bfloat16()
    got = compare_tensors("t", c, r, chunk_elems=2**20)
    rel, amax = _direct(c.cpu(), r.cpu())
    assert got.relative_l2 == pytest.approx(rel, rel=1e-12) and got.max_abs == pytest.approx(amax, rel=1e-12)
    c[5] = float("nan")
    bad = compare_tensors("t", c, r, chunk_elems=2**20)
    assert bad.nonfinite == 1 and bad.relative_l2 == math.inf


def test_integer_tensors_compared_exactly():
    big = torch.tensor([2**62, 1, 2], dtype=torch.int64)
    assert compare_tensors("i", big, big.clone()).relative_l2 == 0.0
    off = big.clone()
    off[0] += 1  # invisible in float64, visible exactly
    assert compare_tensors("i", off, big).relative_l2 == math.inf
    assert compare_tensors("b", torch.tensor([True, False]), torch.tensor([True, True])).relative_l2 == math.inf
    assert compare_tensors("i", torch.arange(4, dtype=torch.int32), torch.arange(4)).relative_l2 == 0.0


def test_empty_tensor():
    assert compare_tensors("e", torch.zeros(0, 3), torch.zeros(0, 3)) == TensorComparison(
        "e", 0.0, 0.0, 0.0, 0.0, 0, 0, 0
    )


def test_compare_runs_streams_one_pair_at_a_time_in_order():
    calls: list[str] = []
    g = torch.Generator().manual_seed(2)
    ref = {n: torch.randn(7, generator=g) for n in ("fwd/b", "fwd/a", "grad/w")}

    def load_c(name: str) -> torch.Tensor:
        calls.append(f"c:{name}")
        return ref[name].bfloat16()

    def load_r(name: str) -> torch.Tensor:
        calls.append(f"r:{name}")
        return ref[name]

    out = compare_runs(["fwd/b", "fwd/a", "grad/w"], load_c, load_r)
    assert [c.name for c in out] == ["fwd/b", "fwd/a", "grad/w"]
    assert calls == ["c:fwd/b", "r:fwd/b", "c:fwd/a", "r:fwd/a", "c:grad/w", "r:grad/w"]
    assert out[1] == compare_tensors("fwd/a", ref["fwd/a"].bfloat16(), ref["fwd/a"])

    def missing(name: str) -> torch.Tensor:
        raise KeyError(name)

    with pytest.raises(KeyError, match="fwd/b"):
        compare_runs(["fwd/b"], missing, load_r)


def test_json_is_strict_and_round_trips():
    c = torch.ones(3)
    c[0] = float("nan")
    d = compare_tensors("t", c, torch.ones(3)).to_dict()
    text = canonical_json(d)
    loaded = json.loads(text, parse_constant=lambda s: pytest.fail(f"non-strict JSON constant {s}"))
    assert loaded["relative_l2"] == "inf" and loaded["nonfinite"] == 1
    for x in (1.5, 0.0, math.inf, -math.inf):
        assert parse_float(json_float(x)) == x
    assert math.isnan(parse_float(json_float(math.nan)))
    with pytest.raises(ValueError):
        parse_float("infinity")
    assert canonical_json({"b": 1, "a": [2.0, math.inf]}) == canonical_json({"a": [2.0, math.inf], "b": 1})
