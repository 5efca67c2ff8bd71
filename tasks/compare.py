"""Per-tensor error metrics, accumulated in float64 and streamed chunk by chunk.

Contract
--------
For a candidate tensor ``c`` and a reference tensor ``r`` of the same shape::

    diff_norm   = ||c - r||_2
    ref_norm    = ||r||_2
    relative_l2 = diff_norm / ref_norm      if ref_norm > 0
                = diff_norm                 if ref_norm == 0   (absolute: the rule's floor judges it)
    max_abs     = max |c - r|               (0.0 for an empty tensor)

- Accumulation is float64. Both tensors are flattened and walked in chunks of ``chunk_elems``
  elements; only one chunk at a time is upcast, so a multi-GB tensor never needs a full float64
  copy. (A non-contiguous input is flattened with one copy in its own dtype.)
- The reduction runs on the candidate's device (CUDA stays on CUDA; one host sync at the end, and a
  second counting pass only when a sum shows a NaN or Inf).
  A reference on another device is moved there one chunk at a time.
- Dtypes may differ (bf16 candidate vs fp32 reference is the normal case); shapes may not:
  a shape mismatch raises ``ComparisonError`` naming the tensor and both shapes.
- Floating dtypes (fp16, bf16, fp32, fp64, ...) are compared numerically. Integer and bool tensors
  are compared exactly: ``relative_l2`` is 0.0 when every element is equal and ``inf`` otherwise
  (``max_abs``/``diff_norm`` still report the float64 difference). Mixing a floating and a
  non-floating tensor, or complex dtypes, raises ``ComparisonError``.
- Non-finite values: ``nonfinite`` counts NaN/Inf in the candidate and ``ref_nonfinite`` in the
  reference. If either is non-zero, ``relative_l2``, ``diff_norm`` and ``max_abs`` are ``inf``:
  such a tensor can never pass any bound. (float64 inputs beyond ~1e154 overflow the sum of
  squares and are treated the same way.)

JSON: ``TensorComparison.to_dict`` writes non-finite floats as the strings ``"inf"``, ``"-inf"``,
``"nan"`` (strict JSON has no Infinity); ``json_float``/``parse_float`` convert both ways and
``canonical_json`` writes any such record deterministically (sorted keys, no timestamps).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "ComparisonError",
    "TensorComparison",
    "canonical_json",
    "compare_runs",
    "compare_tensors",
    "json_float",
    "max_abs",
    "parse_float",
    "relative_l2",
]

# 2**24 elements = 128 MiB per float64 chunk buffer: large enough that per-chunk launch/loop
# overhead is negligible on a GPU, small enough that a few live buffers fit anywhere.
DEFAULT_CHUNK_ELEMS = 2**24


class ComparisonError(ValueError):
    """Two tensors cannot be compared (shape, dtype kind or type); the message names the tensor."""


@dataclass(frozen=True)
class TensorComparison:
    """Metrics of one candidate tensor against its reference (see the module docstring)."""

    name: str
    relative_l2: float
    max_abs: float
    ref_norm: float
    diff_norm: float
    nonfinite: int
    ref_nonfinite: int
    numel: int

    def to_dict(self) -> dict[str, object]:
        """JSON-able dict; non-finite floats become "inf"/"-inf"/"nan"."""
        return {
            "name": self.name,
            "relative_l2": json_float(self.relative_l2),
            "max_abs": json_float(self.max_abs),
            "ref_norm": json_float(self.ref_norm),
            "diff_norm": json_float(self.diff_norm),
            "nonfinite": self.nonfinite,
            "ref_nonfinite": self.ref_nonfinite,
            "numel": self.numel,
        }


def json_float(x: float) -> float | str:
    """A float for strict JSON: finite values unchanged, others as "inf", "-inf" or "nan"."""
    x = float(x)
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def _jsonable(obj: object) -> object:
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def canonical_json(obj: object) -> str:
    """Deterministic strict JSON: sorted keys, indent 2, non-finite floats as strings, final newline."""
    return json.dumps(_jsonable(obj), sort_keys=True, indent=2, allow_nan=False) + "\n"


def parse_float(x: float | int | str) -> float:
    """Inverse of ``json_float``."""
    if isinstance(x, str):
        if x not in ("inf", "-inf", "nan"):
            raise ValueError(f"not a JSON float: {x!r}")
        return float(x)
    return float(x)


def _check(name: str, candidate: object, reference: object) -> bool:
    """Validate a pair; returns True for exact (non-floating) comparison."""
    for label, t in (("candidate", candidate), ("reference", reference)):
        if not isinstance(t, torch.Tensor):
            raise ComparisonError(f"{name}: {label} is {type(t).__name__}, not a torch.Tensor")
        if t.is_complex():
            raise ComparisonError(f"{name}: complex {label} dtype {t.dtype} is not supported")
    assert isinstance(candidate, torch.Tensor) and isinstance(reference, torch.Tensor)
    if tuple(candidate.shape) != tuple(reference.shape):
        raise ComparisonError(
            f"{name}: shape mismatch: candidate {tuple(candidate.shape)} vs reference {tuple(reference.shape)}"
        )
    c_float, r_float = candidate.is_floating_point(), reference.is_floating_point()
    if c_float != r_float:
        raise ComparisonError(
            f"{name}: dtype kind mismatch: candidate {candidate.dtype} vs reference {reference.dtype} "
            "(floating and non-floating tensors cannot be compared)"
        )
    return not c_float


def compare_tensors(
    name: str,
    candidate: torch.Tensor,
    reference: torch.Tensor,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> TensorComparison:
    """Compare one tensor pair in float64, chunked, on the candidate's device."""
    exact = _check(name, candidate, reference)
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    numel = candidate.numel()
    if numel == 0:
        return TensorComparison(name, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)

    device = candidate.device
    c_flat = candidate.detach().reshape(-1)
    r_flat = reference.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sum_d2, sum_r2, amax, mismatches = zero.clone(), zero.clone(), zero.clone(), zero.clone()
    common = torch.promote_types(candidate.dtype, reference.dtype) if exact else None

    for c_chunk, r_chunk in _chunks(c_flat, r_flat, chunk_elems, device):
        if exact:
            # Exactness is decided in the native (promoted) dtype: int64 above 2**53 would round in float64.
            mismatches += (c_chunk.to(common) != r_chunk.to(common)).sum()
        # Upcast one chunk only: this is the float64 working set, bounded by chunk_elems. A floating
        # candidate is upcast inside the subtraction (no float64 copy of it; never written into).
        r64 = r_chunk.to(torch.float64)
        d64 = c_chunk.to(torch.float64, copy=True).sub_(r64) if exact else torch.sub(c_chunk, r64)
        sum_r2 += torch.dot(r64, r64)
        sum_d2 += torch.dot(d64, d64)
        low, high = torch.aminmax(d64)
        amax = torch.maximum(amax, torch.maximum(high, low.neg()))
        del r64, d64

    # One device->host transfer for all accumulators (a mismatch count fits float64 exactly below 2**53).
    d2, r2, max_abs_value, mismatch_count = torch.stack([sum_d2, sum_r2, amax, mismatches]).tolist()
    mismatches = int(mismatch_count)

    if not (math.isfinite(d2) and math.isfinite(r2) and math.isfinite(max_abs_value)):
        # A NaN/Inf in either tensor makes the difference non-finite (float64 sums of finite bf16/fp32
        # values cannot overflow), so only then are non-finite values counted, in a second pass.
        nonfinite, ref_nonfinite = _count_nonfinite(c_flat, r_flat, chunk_elems, device)
        # Non-finite anywhere: every error metric is inf, so no bound can ever accept it.
        ref_norm = math.sqrt(r2) if math.isfinite(r2) else math.inf
        return TensorComparison(name, math.inf, math.inf, ref_norm, math.inf, nonfinite, ref_nonfinite, numel)
    diff_norm, ref_norm = math.sqrt(d2), math.sqrt(r2)
    if exact:
        rel = 0.0 if mismatches == 0 else math.inf
    elif ref_norm > 0.0:
        rel = diff_norm / ref_norm
    else:
        # Zero-norm reference: the relative error is undefined; use the absolute norm so the
        # rule's floor (an absolute term) decides.
        rel = diff_norm
    return TensorComparison(name, rel, max_abs_value, ref_norm, diff_norm, 0, 0, numel)


def _chunks(c_flat: torch.Tensor, r_flat: torch.Tensor, chunk_elems: int, device: torch.device):
    """Aligned chunks of two flat tensors, the reference's moved to the candidate's device."""
    for start in range(0, c_flat.numel(), chunk_elems):
        stop = start + chunk_elems
        yield c_flat[start:stop], r_flat[start:stop].to(device=device, non_blocking=True)


def _count_nonfinite(c_flat: torch.Tensor, r_flat: torch.Tensor, chunk_elems: int,
                     device: torch.device) -> tuple[int, int]:
    """NaN/Inf counts of the candidate and the reference (the rare path: something already is)."""
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for c_chunk, r_chunk in _chunks(c_flat, r_flat, chunk_elems, device):
        counts[0] += torch.isfinite(c_chunk).logical_not_().sum()
        counts[1] += torch.isfinite(r_chunk).logical_not_().sum()
    nonfinite, ref_nonfinite = counts.tolist()
    return nonfinite, ref_nonfinite


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> float:
    """``||c - r|| / ||r||`` in float64 (``||c - r||`` for a zero reference; ``inf`` if non-finite)."""
    return compare_tensors("<tensor>", candidate, reference, chunk_elems=chunk_elems).relative_l2


def max_abs(candidate: torch.Tensor, reference: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> float:
    """``max |c - r|`` in float64 (``inf`` if non-finite)."""
    return compare_tensors("<tensor>", candidate, reference, chunk_elems=chunk_elems).max_abs


def compare_runs(
    names_in_order: Iterable[str],
    load_candidate: Callable[[str], torch.Tensor],
    load_reference: Callable[[str], torch.Tensor],
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> list[TensorComparison]:
    """Compare tensors one pair at a time, in the given order; only one pair is alive at once.

    Loader errors (a missing or tampered blob) propagate unchanged.
    """
    results: list[TensorComparison] = []
    for name in names_in_order:
        candidate = load_candidate(name)
        reference = load_reference(name)
        results.append(compare_tensors(name, candidate, reference, chunk_elems=chunk_elems))
        del candidate, reference  # drop the pair before the next one is loaded
    return results


@dataclass(frozen=True)
class RunDiff:
    """Two stored runs compared name by name."""

    identical: int
    differing: list[TensorComparison]
    only_a: list[str]
    only_b: list[str]


def diff_runs(store: Any, run_a: str, run_b: str, *, device: str = "cpu") -> RunDiff:
    """Byte-identical blobs are counted; the rest are compared (largest relative_l2 first)."""
    a = store.read_manifest(run_a)["tensors"]
    b = store.read_manifest(run_b)["tensors"]
    common = sorted(set(a) & set(b), key=lambda n: a[n]["order"])
    identical = sum(1 for n in common if a[n]["sha256"] == b[n]["sha256"])
    differing = [
        compare_tensors(n, store.get_tensor(a[n]["sha256"], name=n, device=device),
                        store.get_tensor(b[n]["sha256"], name=n, device=device))
        for n in common
        if a[n]["sha256"] != b[n]["sha256"]
    ]
    differing.sort(key=lambda c: -c.relative_l2)
    return RunDiff(identical, differing, sorted(set(a) - set(b)), sorted(set(b) - set(a)))
