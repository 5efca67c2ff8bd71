"""Provider spread, single-provider bounds, ensemble-rule calibration and the gate verdict.

Pure logic: no Prefect import (torch only via compare.py's record types). Inputs are per-provider
error tables ``ProviderErrors`` (tensor name -> relative_l2 of one BF16 provider against the FP32
reference), keyed by provider.

Formulas (``e_p(t)``: provider p's error on tensor t; ``f``: the floor; ``M(t) = max_p e_p(t)``)
------------------------------------------------------------------------------------------------
- single-provider bound (a record, never the gate): ``1.5 * e_default(t) + f``.
- ensemble rule (the gate): ``relative_l2(t) <= k * M(t) + f``, evaluated as the float expression
  ``ensemble_bound(k, M, f) = k * M + f`` everywhere (calibration and verdict share it).
- floor (``derive_floor``): from the FP32 reference's own rounding noise. Given ``fp32_noise``, the
  per-tensor relative_l2 between the FP32 reference and a second FP32 run that differs only in
  rounding (another thread count / BLAS / equivalent arithmetic path), the floor is
  ``max(FLOOR_MIN, FLOOR_NOISE_FACTOR * max_t noise(t))``. Without it the floor falls back to
  ``FLOOR_EPS_MULTIPLE * 2**-24`` (float32 unit roundoff times a reduction-length allowance).
  The floor is absolute where a reference has zero norm (compare.py then reports ||c - r||).
- calibration (``calibrate``), on provider data only: for each held-out provider h and tensor t,
  ``M_h(t) = max e_p(t)`` over p != h (twins of h excluded, below), and the needed factor is
  ``(e_h(t) - f) / M_h(t)`` (0 when ``e_h(t) <= f``). ``r_h`` is the smallest float k with
  ``e_h(t) <= k * M_h(t) + f`` for every t (found by bisection on the float grid, so the statement is
  exact in floating point), recorded
  with the tensor that binds. ``k_raw = max_h r_h`` and ``k = max(1.0, k_raw)``: below 1 the rule
  would reject the providers themselves (a provider p has ``e_p <= M``). Hence, for k_raw >= 1:
  with k every held-out provider passes against the others and with any smaller k one fails.
  Adding a provider can lower k (it raises every other provider's ``M_h``); k is a property of
  the whole ensemble, not monotone in it.
- twins: providers whose errors are equal on every tensor ran the same arithmetic on this host (on a
  CPU without AVX-512, oneDNN runs no BF16 GEMM, so "oneDNN off" changes nothing). A held-out
  provider is measured against the others *minus its twins*: a twin would predict it exactly and
  pull its ratio to 1, so the ensemble's real spread, the thing leave-one-out estimates, would be
  lost (measured on the tiny preset with oneDNN's BF16 GEMMs off: k fell to 1.0 and the honest
  candidate failed). The excluded twins are recorded with each held-out ratio.

Rejected (``CalibrationError``): fewer than three providers; tensor sets that differ between
providers (the missing tensors are named); NaN, Inf or negative errors; an empty tensor set; a
tensor where every other provider has zero error but the held-out one exceeds the floor (its
factor is infinite; the tensor is named); providers that are all twins of one another (no
spread). ``verdict`` raises ``RuleError`` if a rule tensor has no execution order.

Verdict: per rule tensor ``bound = k * M(t) + f``, ``ratio = error / bound``, pass iff the error is
finite, nothing is non-finite, and ``error <= bound``. Overall pass iff every rule tensor was
compared and passes and no ledger node is missing. ``first_drift`` is the first tensor in
execution order (``order``, never name order) with ``error > M(t)`` (informative, also on a pass).

JSON: all writers emit strict JSON (non-finite floats as "inf"/"-inf"/"nan", see compare.py) with
sorted keys (``canonical_json``); no timestamps, so equal inputs give byte-equal files.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tasks.compare import TensorComparison, canonical_json, json_float, parse_float

ProviderErrors = dict[str, float]

# Single-provider bounds allow 50% above the default provider's own error: the seed project's
# record-keeping rule, kept for comparison with the ensemble rule (it does not gate).
SINGLE_PROVIDER_FACTOR = 1.5
# Leave-one-out needs at least two providers left to form a maximum over "the others".
MIN_PROVIDERS = 3
FP32_UNIT_ROUNDOFF = 2.0**-24
# Fallback floor = 256 u_fp32 ~ 1.5e-5: a random-walk rounding error grows like sqrt(n) u, and
# sqrt(65536) = 256 covers H3's longest reductions (attention over S ~ 30k, FFN width 14336).
# It stays two orders below bf16 roundoff (2**-8 ~ 3.9e-3), so it matters only near zero error.
FLOOR_EPS_MULTIPLE = 256
# A second FP32 run is one sample of the reference's rounding noise; doubling its worst tensor
# covers the sample-to-sample spread of that noise.
FLOOR_NOISE_FACTOR = 2.0
# Never below 1e-6 (~17 u_fp32): an FP32 rerun that happens to agree bit-for-bit is no evidence
# that the reference is exact.
FLOOR_MIN = 1e-6

RULE_SCHEMA = "h3gate.ensemble-rule/1"
VERDICT_SCHEMA = "h3gate.verdict/1"
REPORT_SCHEMA = "h3gate.provider-report/1"
THRESHOLDS_SCHEMA = "h3gate.thresholds/1"


class RuleError(ValueError):
    """Inputs to a rule are inconsistent; the message names what is wrong."""


class CalibrationError(RuleError):
    """The ensemble rule cannot be calibrated from these providers."""


def tensor_kind(name: str) -> str:
    """The kind of a captured tensor: the name prefix before "/" ("out", "grad", ...)."""
    return name.split("/", 1)[0] if "/" in name else ""


def ensemble_bound(k: float, max_error: float, floor: float) -> float:
    """``k * max_error + floor``: the one float expression used by calibration and verdict."""
    return k * max_error + floor


def _names(items: Iterable[str], limit: int = 10) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def _check_value(label: str, value: float) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{label}={value!r} (not a number)"
    if not math.isfinite(value) or value < 0:
        return f"{label}={value!r}"
    return None


def _check_floor(floor: float) -> None:
    if _check_value("floor", floor):
        raise RuleError(f"floor must be finite and >= 0, got {floor!r}")


def _validate_errors(errors_by_provider: Mapping[str, Mapping[str, float]], min_providers: int) -> list[str]:
    """Check providers and tensors; return the sorted tensor names."""
    providers = sorted(errors_by_provider)
    if len(providers) < min_providers:
        raise CalibrationError(
            f"need at least {min_providers} providers, got {len(providers)}: {_names(providers) or '(none)'}"
        )
    union = sorted(set().union(*(set(errors_by_provider[p]) for p in providers)))
    if not union:
        raise CalibrationError("the providers have no tensors")
    gaps = [
        f"{p} lacks {_names(sorted(set(union) - set(errors_by_provider[p])))}"
        for p in providers
        if len(errors_by_provider[p]) != len(union)
    ]
    if gaps:
        raise CalibrationError("providers disagree on the tensor set: " + "; ".join(gaps))
    bad = [msg for p in providers for t in union if (msg := _check_value(f"{p}:{t}", errors_by_provider[p][t]))]
    if bad:
        raise CalibrationError("provider errors must be finite and >= 0: " + _names(bad))
    return union


# -- floor ---------------------------------------------------------------------------------------


def _check_noise(fp32_noise: Mapping[str, float]) -> None:
    if not fp32_noise:
        raise RuleError("fp32_noise is empty: pass None to use the float32-epsilon fallback")
    bad = [msg for t, v in sorted(fp32_noise.items()) if (msg := _check_value(t, v))]
    if bad:
        raise RuleError("FP32 noise must be finite and >= 0: " + _names(bad))


def derive_floor(fp32_noise: Mapping[str, float] | None) -> float:
    """The rule's absolute floor from the FP32 reference's own rounding noise (module docstring)."""
    if fp32_noise is None:
        return FLOOR_EPS_MULTIPLE * FP32_UNIT_ROUNDOFF
    _check_noise(fp32_noise)
    return max(FLOOR_MIN, FLOOR_NOISE_FACTOR * max(fp32_noise.values()))


def floor_method(fp32_noise: Mapping[str, float] | None) -> str:
    """A deterministic description of how ``derive_floor`` obtained its value, for the rule file."""
    if fp32_noise is None:
        return f"fp32-epsilon: {FLOOR_EPS_MULTIPLE} * 2**-24 (no FP32 noise run given)"
    _check_noise(fp32_noise)
    worst = max(sorted(fp32_noise), key=lambda t: fp32_noise[t])
    return (
        f"fp32-noise: max({FLOOR_MIN:g}, {FLOOR_NOISE_FACTOR:g} * max relative_l2 of an FP32 rerun "
        f"over {len(fp32_noise)} tensors; worst {worst} = {fp32_noise[worst]!r})"
    )


# -- records: provider report, spread, single-provider bounds --------------------------------------


def provider_report(
    provider: str, comparisons: Iterable[TensorComparison], *, reference_run: str, provider_run: str
) -> dict[str, object]:
    """report.json content for one provider: its comparisons (in the given order) and the run ids."""
    tensors = [c.to_dict() for c in comparisons]
    names = [str(t["name"]) for t in tensors]
    if len(set(names)) != len(names):
        raise RuleError(
            f"{provider}: duplicate tensors in report: {_names(sorted({n for n in names if names.count(n) > 1}))}"
        )
    errors = {t["name"]: parse_float(t["relative_l2"]) for t in tensors}  # type: ignore[arg-type]
    worst = max(names, key=lambda n: errors[n]) if names else None
    return {
        "schema": REPORT_SCHEMA,
        "provider": provider,
        "reference_run": reference_run,
        "provider_run": provider_run,
        "tensors": tensors,
        "summary": {
            "tensors": len(tensors),
            "worst": worst,
            "worst_relative_l2": json_float(errors[worst]) if worst is not None else None,
            "nonfinite": [str(t["name"]) for t in tensors if t["nonfinite"] or t["ref_nonfinite"]],
        },
    }


def errors_from_report(report: Mapping[str, object]) -> ProviderErrors:
    """The ``ProviderErrors`` table (name -> relative_l2) of a ``provider_report`` dict."""
    return {str(t["name"]): parse_float(t["relative_l2"]) for t in report["tensors"]}  # type: ignore[union-attr,index]


def spread(errors_by_provider: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, object]]:
    """Per tensor: min, max, ratio = max/min (1.0 if both are 0, inf if only min is), outlier, by_provider.

    The outlier is the provider with the largest error (ties: first by provider name).
    """
    names = _validate_errors(errors_by_provider, 1)
    providers = sorted(errors_by_provider)
    out: dict[str, dict[str, object]] = {}
    for t in names:
        by = {p: float(errors_by_provider[p][t]) for p in providers}
        lo, hi = min(by.values()), max(by.values())
        ratio = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
        outlier = next(p for p in providers if by[p] == hi)
        out[t] = {"min": lo, "max": hi, "ratio": ratio, "outlier": outlier, "by_provider": by}
    return out


def single_provider_bounds(default_errors: Mapping[str, float], floor: float) -> dict[str, float]:
    """``SINGLE_PROVIDER_FACTOR * e_default(t) + floor`` per tensor (a record, not the gate)."""
    _check_floor(floor)
    bad = [msg for t, v in sorted(default_errors.items()) if (msg := _check_value(t, v))]
    if bad:
        raise RuleError("default provider errors must be finite and >= 0: " + _names(bad))
    return {t: SINGLE_PROVIDER_FACTOR * float(e) + floor for t, e in sorted(default_errors.items())}


def thresholds_json(
    bounds: Mapping[str, float],
    report_hashes: Mapping[str, str],
    *,
    floor: float | None = None,
    factor: float = SINGLE_PROVIDER_FACTOR,
) -> dict[str, object]:
    """thresholds.json content: single-provider bounds and the sha256 of the reports they came from."""
    if not report_hashes:
        raise RuleError("thresholds need the hashes of the provider reports they came from")
    return {
        "schema": THRESHOLDS_SCHEMA,
        "factor": factor,
        "floor": floor,
        "bounds": {t: float(b) for t, b in sorted(bounds.items())},
        "reports": dict(sorted(report_hashes.items())),
    }


# -- calibration ---------------------------------------------------------------------------------


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def _min_factor(pairs: Sequence[tuple[str, float, float]], floor: float) -> tuple[float, str | None]:
    """Smallest float k >= 0 with ``e <= ensemble_bound(k, m, floor)`` for all (tensor, e, m), m > 0."""

    def fails(k: float) -> bool:
        return any(not e <= ensemble_bound(k, m, floor) for _, e, m in pairs)

    if not fails(0.0):
        return 0.0, None  # every held-out error is at or below the floor
    approx = {t: (e - floor) / m for t, e, m in pairs}
    hi = max(max(approx.values()), 5e-324)
    while fails(hi):  # the float expression can need slightly (rarely 2x) more than the real ratio
        hi *= 2.0
        if not math.isfinite(hi):
            worst = max(sorted(approx), key=lambda t: approx[t])
            raise CalibrationError(f"leave-one-out factor overflows on tensor {worst}")
    lo_b, hi_b = _bits(0.0), _bits(hi)  # positive floats are ordered like their bit patterns
    while hi_b - lo_b > 1:
        mid = (lo_b + hi_b) // 2
        if fails(_from_bits(mid)):
            lo_b = mid
        else:
            hi_b = mid
    below = _from_bits(lo_b)
    binding = [t for t, e, m in pairs if not e <= ensemble_bound(below, m, floor)]
    return _from_bits(hi_b), max(binding, key=lambda t: approx[t])


@dataclass(frozen=True)
class EnsembleRule:
    """The calibrated gate: ``relative_l2(t) <= k * max_provider_error[t] + floor`` for every t."""

    k: float
    k_raw: float  # max leave-one-out factor before the k >= 1 clamp
    floor: float
    floor_method: str
    providers: tuple[str, ...]
    # provider -> {"ratio": float, "tensor": str | None, "twins": [providers left out as identical to it]}
    leave_one_out: Mapping[str, Mapping[str, object]]
    max_provider_error: Mapping[str, float]
    reference_manifest_sha: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.k) and self.k > 0) or _check_value("k_raw", self.k_raw):
            raise RuleError(f"rule k must be finite and > 0 (k={self.k!r}, k_raw={self.k_raw!r})")
        _check_floor(self.floor)
        if not self.max_provider_error:
            raise RuleError("rule has no tensors")
        bad = [msg for t, v in sorted(self.max_provider_error.items()) if (msg := _check_value(t, v))]
        if bad:
            raise RuleError("rule max_provider_error must be finite and >= 0: " + _names(bad))

    def to_dict(self) -> dict[str, object]:
        return {
            "schema": RULE_SCHEMA,
            "k": self.k,
            "k_raw": self.k_raw,
            "floor": self.floor,
            "floor_method": self.floor_method,
            "providers": list(self.providers),
            "leave_one_out": {p: dict(v) for p, v in sorted(self.leave_one_out.items())},
            "max_provider_error": dict(sorted(self.max_provider_error.items())),
            "reference_manifest_sha": self.reference_manifest_sha,
        }

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, object]) -> EnsembleRule:
        d = json.loads(data) if isinstance(data, (str, bytes)) else data
        if d.get("schema") != RULE_SCHEMA:
            raise RuleError(f"not an ensemble rule: schema {d.get('schema')!r}, expected {RULE_SCHEMA!r}")
        return cls(
            k=float(d["k"]),
            k_raw=float(d["k_raw"]),
            floor=float(d["floor"]),
            floor_method=str(d["floor_method"]),
            providers=tuple(d["providers"]),
            leave_one_out={
                p: {"ratio": float(v["ratio"]), "tensor": v["tensor"], "twins": list(v.get("twins", []))}
                for p, v in d["leave_one_out"].items()
            },
            max_provider_error={t: float(v) for t, v in d["max_provider_error"].items()},
            reference_manifest_sha=str(d["reference_manifest_sha"]),
        )


def calibrate(
    errors_by_provider: Mapping[str, Mapping[str, float]],
    floor: float,
    *,
    reference_manifest_sha: str,
    floor_method: str = "given",
) -> EnsembleRule:
    """Calibrate k by leave-one-out over the providers (module docstring); provider data only."""
    names = _validate_errors(errors_by_provider, MIN_PROVIDERS)
    _check_floor(floor)
    providers = sorted(errors_by_provider)
    e = {p: {t: float(errors_by_provider[p][t]) for t in names} for p in providers}
    twins = {h: [p for p in providers if p != h and e[p] == e[h]] for h in providers}
    if len(twins[providers[0]]) == len(providers) - 1:  # twin of every other: all are one arithmetic path
        raise CalibrationError(
            f"the providers {_names(providers)} have identical errors on every tensor: they ran one arithmetic "
            "path on this host, so there is no spread to calibrate k from; add a provider that differs"
        )
    infinite: list[str] = []
    leave_one_out: dict[str, dict[str, object]] = {}
    for h in providers:
        others = [p for p in providers if p != h and p not in twins[h]]
        pairs: list[tuple[str, float, float]] = []
        for t in names:
            m = max(e[p][t] for p in others)
            if m > 0.0:
                pairs.append((t, e[h][t], m))
            elif e[h][t] > floor:  # no factor can cover it: 0 * k + floor < e_h
                infinite.append(f"{t} (held out {h}: {e[h][t]!r} > floor {floor!r}, others all 0)")
        ratio, tensor = _min_factor(pairs, floor)
        leave_one_out[h] = {"ratio": ratio, "tensor": tensor, "twins": twins[h]}
    if infinite:
        raise CalibrationError("leave-one-out factor is infinite on: " + _names(infinite))
    k_raw = max(float(v["ratio"]) for v in leave_one_out.values())  # type: ignore[arg-type]
    return EnsembleRule(
        k=max(1.0, k_raw),  # k < 1 would reject the providers themselves
        k_raw=k_raw,
        floor=float(floor),
        floor_method=floor_method,
        providers=tuple(providers),
        leave_one_out=leave_one_out,
        max_provider_error={t: max(e[p][t] for p in providers) for t in names},
        reference_manifest_sha=reference_manifest_sha,
    )


# -- verdict -------------------------------------------------------------------------------------

CandidateEntry = TensorComparison | tuple[float, float | None, int] | float


def _entry(name: str, value: object) -> tuple[float, float | None, int]:
    """(relative_l2, max_abs, nonfinite) from a TensorComparison-like, a tuple or a bare float."""
    if hasattr(value, "relative_l2"):
        rel, mabs, nf = value.relative_l2, getattr(value, "max_abs", None), getattr(value, "nonfinite", 0)
    elif isinstance(value, (tuple, list)) and len(value) == 3:
        rel, mabs, nf = value
    elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
        rel, mabs, nf = value, None, 0
    else:
        raise RuleError(f"{name}: candidate entry {value!r} is not (relative_l2, max_abs, nonfinite)")
    rel = parse_float(rel)
    mabs = None if mabs is None else parse_float(mabs)
    if rel < 0 or (mabs is not None and mabs < 0):
        raise RuleError(f"{name}: negative error (relative_l2={rel!r}, max_abs={mabs!r})")
    return rel, mabs, int(nf)


@dataclass(frozen=True)
class TensorVerdict:
    """One gated tensor: its error, bound, ratio to the bound, and the single-provider record."""

    name: str
    order: int
    kind: str
    relative_l2: float
    max_abs: float | None
    nonfinite: int
    max_provider_error: float
    bound: float
    ratio: float
    passed: bool
    drift: bool  # relative_l2 > max_provider_error (or non-finite)
    single_bound: float | None
    single_passed: bool | None


@dataclass(frozen=True)
class Verdict:
    """The gate's answer; ``tensors`` and every name list are in execution order."""

    passed: bool
    k: float
    floor: float
    providers: tuple[str, ...]
    reference_manifest_sha: str
    tensors: tuple[TensorVerdict, ...]
    failures: tuple[str, ...]  # failing or missing rule tensors
    missing: tuple[str, ...]  # rule tensors the candidate did not provide
    nonfinite: tuple[str, ...]
    ledger_missing: tuple[str, ...]  # candidate nodes that never ran (sorted)
    ungated: tuple[str, ...]  # candidate tensors the rule does not know (recorded, not gated)
    worst: str | None
    first_drift: str | None
    single_provider_passed: bool | None  # None without single_bounds
    single_provider_failures: tuple[str, ...]

    def tensor(self, name: str) -> TensorVerdict:
        return next(t for t in self.tensors if t.name == name)

    def to_dict(self) -> dict[str, object]:
        worst = self.tensor(self.worst) if self.worst is not None else None
        drift = self.tensor(self.first_drift) if self.first_drift is not None else None
        return {
            "schema": VERDICT_SCHEMA,
            "passed": self.passed,
            "k": self.k,
            "floor": self.floor,
            "providers": list(self.providers),
            "reference_manifest_sha": self.reference_manifest_sha,
            "gated": len(self.tensors) + len(self.missing),
            "compared": len(self.tensors),
            "failures": list(self.failures),
            "missing": list(self.missing),
            "nonfinite": list(self.nonfinite),
            "ledger_missing": list(self.ledger_missing),
            "ungated": list(self.ungated),
            "worst": None
            if worst is None
            else {"tensor": worst.name, "ratio": worst.ratio, "relative_l2": worst.relative_l2, "bound": worst.bound},
            "first_drift": None
            if drift is None
            else {
                "tensor": drift.name,
                "order": drift.order,
                "relative_l2": drift.relative_l2,
                "max_provider_error": drift.max_provider_error,
            },
            "single_provider": {"passed": self.single_provider_passed, "failures": list(self.single_provider_failures)},
            "tensors": [dict(vars(t)) for t in self.tensors],
        }

    def to_json(self) -> str:
        return canonical_json(self.to_dict())


def verdict(
    candidate: Mapping[str, CandidateEntry],
    rule: EnsembleRule,
    order: Mapping[str, int],
    *,
    single_bounds: Mapping[str, float] | None = None,
    ledger_missing: Iterable[str] = (),
) -> Verdict:
    """Gate a candidate's per-tensor errors against the ensemble rule (module docstring)."""
    unordered = sorted(t for t in rule.max_provider_error if t not in order)
    if unordered:
        raise RuleError(f"rule tensors without an execution order: {_names(unordered)}")
    gated = sorted(rule.max_provider_error, key=lambda t: (order[t], t))
    rows: list[TensorVerdict] = []
    failures: list[str] = []
    missing: list[str] = []
    nonfinite: list[str] = []
    for t in gated:
        if t not in candidate:
            missing.append(t)
            failures.append(t)
            continue
        rel, mabs, nf = _entry(t, candidate[t])
        m = rule.max_provider_error[t]
        bound = ensemble_bound(rule.k, m, rule.floor)
        finite = nf == 0 and math.isfinite(rel) and (mabs is None or math.isfinite(mabs))
        passed = finite and rel <= bound
        ratio = math.inf if not finite or (bound == 0 and rel > 0) else (rel / bound if bound > 0 else 0.0)
        if not finite:
            nonfinite.append(t)
        sb = None if single_bounds is None else single_bounds.get(t)
        sp = None if sb is None else bool(finite and rel <= sb)
        drift = not (finite and rel <= m)
        rows.append(TensorVerdict(t, order[t], tensor_kind(t), rel, mabs, nf, m, bound, ratio, passed, drift, sb, sp))
        if not passed:
            failures.append(t)
    ledger = tuple(sorted(set(ledger_missing)))
    worst = max(rows, key=lambda r: r.ratio).name if rows else None  # max() keeps the first (execution order) on ties
    first_drift = next((r.name for r in rows if r.drift), None)
    single_failures = tuple(r.name for r in rows if r.single_passed is False) + (
        tuple(missing) if single_bounds is not None else ()
    )
    ungated = sorted(
        (t for t in candidate if t not in rule.max_provider_error), key=lambda t: (order.get(t, math.inf), t)
    )
    return Verdict(
        passed=bool(gated) and not failures and not ledger,
        k=rule.k,
        floor=rule.floor,
        providers=tuple(rule.providers),
        reference_manifest_sha=rule.reference_manifest_sha,
        tensors=tuple(rows),
        failures=tuple(failures),
        missing=tuple(missing),
        nonfinite=tuple(nonfinite),
        ledger_missing=ledger,
        ungated=tuple(ungated),
        worst=worst,
        first_drift=first_drift,
        single_provider_passed=None if single_bounds is None else not single_failures,
        single_provider_failures=single_failures,
    )


def summarize(v: Verdict) -> str:
    """A few lines for the CLI."""
    gated = len(v.tensors) + len(v.missing)
    rule = f"k={v.k:.4g} x max provider error + floor {v.floor:.3g}"
    worst = v.tensor(v.worst) if v.worst else None
    worst_txt = f"worst {worst.name} at {worst.ratio:.3g} x its bound" if worst else "nothing compared"
    drift_txt = f"first drift {v.first_drift} (order {v.tensor(v.first_drift).order})" if v.first_drift else "no drift"
    if v.passed:
        lines = [f"PASS: {gated}/{gated} tensors within {rule}", f"{worst_txt}; {drift_txt}"]
    else:
        over = [t for t in v.failures if t not in v.missing]
        lines = [f"FAIL: {len(over)} of {gated} tensors over {rule}" + (f" (first: {over[0]})" if over else "")]
        lines.append(f"{worst_txt}; {drift_txt}")
        if v.nonfinite:
            lines.append(f"non-finite: {_names(v.nonfinite)}")
        if v.missing:
            lines.append(f"missing from the candidate: {_names(v.missing)}")
        if v.ledger_missing:
            lines.append(f"candidate nodes that never ran: {_names(v.ledger_missing)}")
        if not gated:
            lines.append("the rule gates no tensors")
    if v.single_provider_passed is not None:
        sp = "pass" if v.single_provider_passed else f"fail ({_names(v.single_provider_failures, 3)})"
        lines.append(f"single-provider record (not gating): {sp}")
    return "\n".join(lines)
