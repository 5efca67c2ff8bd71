"""tasks/rules.py: the calibration and verdict claims, as properties, plus every refusal."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tasks.compare import TensorComparison
from tasks.rules import (
    FLOOR_EPS_MULTIPLE,
    FLOOR_MIN,
    FLOOR_NOISE_FACTOR,
    SINGLE_PROVIDER_FACTOR,
    CalibrationError,
    EnsembleRule,
    RuleError,
    calibrate,
    derive_floor,
    ensemble_bound,
    errors_from_report,
    floor_method,
    provider_report,
    single_provider_bounds,
    spread,
    summarize,
    tensor_kind,
    thresholds_json,
    verdict,
)

SHA = "0" * 64
NAMES = ["out/sample", "dinput/hidden_states", "grad/w0", "grad/w1", "fwd/blocks.0", "bwd/blocks.0", "fwd/b1", "x"]

# Errors between 1e-6 and 1e-1, as BF16-vs-FP32 errors are: drawn on a log scale so ratios vary widely.
error = st.floats(-6.0, -1.0).map(lambda x: 10.0**x)
floors = st.one_of(st.just(0.0), st.floats(-9.0, -4.0).map(lambda x: 10.0**x))


@st.composite
def ensembles(draw: st.DrawFn, min_providers: int = 3, max_providers: int = 6) -> dict[str, dict[str, float]]:
    n_t = draw(st.integers(1, len(NAMES)))
    n_p = draw(st.integers(min_providers, max_providers))
    errors = {f"p{i}": {t: draw(error) for t in NAMES[:n_t]} for i in range(n_p)}
    assume(len({tuple(e.values()) for e in errors.values()}) > 1)  # all-identical providers are refused (own test)
    return errors


def _order(errors: dict[str, dict[str, float]]) -> dict[str, int]:
    return {t: i for i, t in enumerate(next(iter(errors.values())))}


def _held_out_rule(rule: EnsembleRule, errors: dict[str, dict[str, float]], h: str) -> EnsembleRule:
    """The calibrated rule with its maxima taken over every provider but h and h's twins."""
    others = {t: max(e[t] for p, e in errors.items() if e != errors[h]) for t in errors[h]}
    return dataclasses.replace(rule, max_provider_error=others)


def _passes(candidate: dict[str, float], rule: EnsembleRule, order: dict[str, int]) -> bool:
    return verdict(candidate, rule, order).passed


@settings(max_examples=150, deadline=None)
@given(errors=ensembles(), floor=floors)
def test_calibrated_k_is_the_smallest_that_passes_every_held_out_provider(errors, floor):
    rule = calibrate(errors, floor, reference_manifest_sha=SHA)
    order = _order(errors)
    assert rule.k == max(1.0, rule.k_raw)
    assert rule.k_raw == max(v["ratio"] for v in rule.leave_one_out.values())
    for h in errors:
        assert _passes(errors[h], _held_out_rule(rule, errors, h), order), h
    if rule.k_raw >= 1.0:  # the clamp: below k_raw = 1 a smaller k may still pass everyone
        for smaller in (math.nextafter(rule.k, 0.0), rule.k * (1 - 1e-9)):
            assert not all(
                _passes(errors[h], dataclasses.replace(_held_out_rule(rule, errors, h), k=smaller), order)
                for h in errors
            )
        # the recorded worst tensor of the binding provider is the one that fails below k
        h = next(p for p, v in rule.leave_one_out.items() if v["ratio"] == rule.k_raw)
        below = dataclasses.replace(_held_out_rule(rule, errors, h), k=math.nextafter(rule.k, 0.0))
        assert rule.leave_one_out[h]["tensor"] in verdict(errors[h], below, order).failures
    else:
        assert rule.k == 1.0


@settings(max_examples=100, deadline=None)
@given(errors=ensembles(), floor=floors, j=st.integers(-20, 20), cand=st.lists(error, min_size=8, max_size=8))
def test_scaling_errors_and_floor_leaves_k_and_verdicts_unchanged(errors, floor, j, cand):
    c = 2.0**j  # a power of two scales every float exactly, so "unchanged" can be exact
    rule = calibrate(errors, floor, reference_manifest_sha=SHA)
    scaled = calibrate(
        {p: {t: c * v for t, v in e.items()} for p, e in errors.items()}, c * floor, reference_manifest_sha=SHA
    )
    assert scaled.k == rule.k and scaled.k_raw == rule.k_raw and scaled.leave_one_out == rule.leave_one_out
    order = _order(errors)
    candidate = dict(zip(order, cand, strict=False))
    v1 = verdict(candidate, rule, order)
    v2 = verdict({t: c * v for t, v in candidate.items()}, scaled, order)
    assert (v1.passed, v1.failures, v1.first_drift, v1.worst) == (v2.passed, v2.failures, v2.first_drift, v2.worst)


@settings(max_examples=50, deadline=None)
@given(errors=ensembles(), floor=floors, c=st.floats(1e-3, 1e3))
def test_scaling_by_any_positive_factor_keeps_k_to_rounding(errors, floor, c):
    rule = calibrate(errors, floor, reference_manifest_sha=SHA)
    scaled = calibrate(
        {p: {t: c * v for t, v in e.items()} for p, e in errors.items()}, c * floor, reference_manifest_sha=SHA
    )
    assert math.isclose(scaled.k, rule.k, rel_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(errors=ensembles(max_providers=5), floor=floors, extra=st.lists(error, min_size=8, max_size=8))
def test_adding_a_provider_never_raises_a_subset_providers_factor(errors, floor, extra):
    names = list(next(iter(errors.values())))
    bigger = {**errors, "new": dict(zip(names, extra, strict=False))}
    small, big = (
        calibrate(errors, floor, reference_manifest_sha=SHA),
        calibrate(bigger, floor, reference_manifest_sha=SHA),
    )
    for h in errors:  # more "others" can only raise max_{p != h}, so h needs no larger factor
        assert big.leave_one_out[h]["ratio"] <= small.leave_one_out[h]["ratio"]
    # k is the max over the whole ensemble, so it covers what every subset member needs inside it
    assert big.k_raw == max(v["ratio"] for v in big.leave_one_out.values())
    assert all(big.k >= v["ratio"] for v in big.leave_one_out.values())


def test_adding_a_provider_can_lower_k():
    """Documented behaviour: a lone outlier forces k up; a second provider close to it brings k down."""
    three = {"a": {"t": 10.0}, "b": {"t": 1.0}, "c": {"t": 1.5}}
    assert calibrate(three, 0.0, reference_manifest_sha=SHA).k == pytest.approx(10.0 / 1.5)
    assert calibrate({**three, "d": {"t": 9.0}}, 0.0, reference_manifest_sha=SHA).k == pytest.approx(10.0 / 9.0)


@settings(max_examples=100, deadline=None)
@given(errors=ensembles(max_providers=5), floor=floors, which=st.integers(0, 4))
def test_a_twin_provider_changes_no_ratio(errors, floor, which):
    """A provider identical to another on every tensor (oneDNN off where oneDNN runs no BF16 GEMM) is the same
    arithmetic twice: it must not predict its twin, so k and every held-out ratio stay as without it."""
    original = sorted(errors)[which % len(errors)]
    with_twin = {**errors, "twin": dict(errors[original])}
    base = calibrate(errors, floor, reference_manifest_sha=SHA)
    twinned = calibrate(with_twin, floor, reference_manifest_sha=SHA)
    assert (twinned.k, twinned.k_raw) == (base.k, base.k_raw)
    assert twinned.leave_one_out["twin"]["ratio"] == base.leave_one_out[original]["ratio"]
    for p in errors:
        assert twinned.leave_one_out[p]["ratio"] == base.leave_one_out[p]["ratio"]
    assert "twin" in twinned.leave_one_out[original]["twins"] and original in twinned.leave_one_out["twin"]["twins"]


def test_twins_pulling_k_to_one_are_measured_against_the_rest():
    """Two pairs of twins (the CPU set on a host without oneDNN BF16 GEMMs): without the twin rule each held-out
    provider's twin predicts it exactly and k collapses to 1; with it, each pair is measured against the other."""
    errors = {"default": {"t": 2.0, "u": 1.0}, "no-onednn": {"t": 2.0, "u": 1.0},
              "math": {"t": 1.0, "u": 1.25}, "math-no-onednn": {"t": 1.0, "u": 1.25}}
    rule = calibrate(errors, 0.0, reference_manifest_sha=SHA)
    assert rule.k == 2.0 and rule.leave_one_out["default"] == {"ratio": 2.0, "tensor": "t", "twins": ["no-onednn"]}
    assert rule.leave_one_out["math"]["ratio"] == 1.25 and rule.leave_one_out["math"]["tensor"] == "u"


def test_all_identical_providers_are_refused():
    same = {"t": 0.01, "u": 0.02}
    with pytest.raises(CalibrationError, match="identical errors on every tensor.*no spread"):
        calibrate({"a": dict(same), "b": dict(same), "c": dict(same)}, 0.0, reference_manifest_sha=SHA)


@settings(max_examples=100, deadline=None)
@given(errors=ensembles(), floor=floors, which=st.integers(0, 5))
def test_candidate_equal_to_a_provider_passes(errors, floor, which):
    rule = calibrate(errors, floor, reference_manifest_sha=SHA)
    p = sorted(errors)[which % len(errors)]
    v = verdict(errors[p], rule, _order(errors))
    assert v.passed and not v.failures and v.first_drift is None


@st.composite
def tight_ensembles(draw: st.DrawFn) -> dict[str, dict[str, float]]:
    """Providers within a factor 2 of each other: k <= 2, far below 10."""
    n_t = draw(st.integers(1, len(NAMES)))
    base = {t: 10.0 ** draw(st.floats(-4.0, -2.0)) for t in NAMES[:n_t]}
    n_p = draw(st.integers(3, 6))
    errors = {f"p{i}": {t: b * draw(st.floats(1.0, 2.0)) for t, b in base.items()} for i in range(n_p)}
    assume(len({tuple(e.values()) for e in errors.values()}) > 1)
    return errors


@settings(max_examples=100, deadline=None)
@given(errors=tight_ensembles(), floor=st.floats(0.0, 1e-6), which=st.integers(0, 7), src=st.integers(0, 5))
def test_one_tensor_ten_times_worse_fails_and_is_named(errors, floor, which, src):
    rule = calibrate(errors, floor, reference_manifest_sha=SHA)
    names = list(_order(errors))
    bad = names[which % len(names)]
    candidate = dict(errors[sorted(errors)[src % len(errors)]])
    candidate[bad] = 10.0 * max(e[bad] for e in errors.values())
    v = verdict(candidate, rule, _order(errors))
    assert not v.passed
    assert v.failures == (bad,) and v.worst == bad and v.first_drift == bad
    assert bad in summarize(v) and summarize(v).startswith("FAIL")


@settings(max_examples=60, deadline=None)
@given(errors=ensembles(), which=st.integers(0, 7), how=st.sampled_from(["nan", "inf", "count", "max_abs"]))
def test_nonfinite_anywhere_fails(errors, which, how):
    rule = calibrate(errors, 1e-5, reference_manifest_sha=SHA)
    names = list(_order(errors))
    bad = names[which % len(names)]
    candidate: dict[str, object] = {t: (e, 0.0, 0) for t, e in errors["p0"].items()}
    candidate[bad] = {
        "nan": (math.nan, 0.0, 0),
        "inf": (math.inf, 0.0, 0),
        "count": (0.0, 0.0, 1),
        "max_abs": (0.0, math.nan, 0),
    }[how]
    v = verdict(candidate, rule, _order(errors))
    assert not v.passed and bad in v.failures and v.nonfinite == (bad,) and v.tensor(bad).ratio == math.inf
    assert json.loads(v.to_json())["tensors"][names.index(bad)]["ratio"] == "inf"


def test_nan_or_negative_provider_errors_refused():
    good = {"a": {"t": 1e-3}, "b": {"t": 1e-3}}
    for bad in (math.nan, math.inf, -1e-3):
        with pytest.raises(CalibrationError, match="c:t"):
            calibrate({**good, "c": {"t": bad}}, 0.0, reference_manifest_sha=SHA)


@settings(max_examples=60, deadline=None)
@given(perm=st.permutations(list(range(8))), drifting=st.sets(st.integers(0, 7), min_size=1))
def test_first_drift_follows_execution_order(perm, drifting):
    errors = {p: {t: e for t in NAMES} for p, e in (("a", 1e-3), ("b", 0.999e-3), ("c", 0.998e-3))}
    rule = calibrate(errors, 1e-6, reference_manifest_sha=SHA)
    assert rule.k == 1.0
    order = {t: perm[i] for i, t in enumerate(NAMES)}
    candidate = {t: (1e-3 + 5e-7 if i in drifting else 1e-3) for i, t in enumerate(NAMES)}
    v = verdict(candidate, rule, order)
    assert v.passed  # above max_p err_p (drift) but within k * 1e-3 + floor, k = 1
    assert v.first_drift == min((NAMES[i] for i in drifting), key=lambda t: order[t])
    assert [t.order for t in v.tensors] == sorted(order.values())


def test_first_drift_is_not_name_order():
    errors = {p: {"a": e, "b": e} for p, e in (("x", 1e-3), ("y", 0.9e-3), ("z", 0.8e-3))}
    rule = calibrate(errors, 0.0, reference_manifest_sha=SHA)
    v = verdict({"a": 5e-3, "b": 5e-3}, rule, {"b": 0, "a": 1})
    assert v.first_drift == "b" and v.failures == ("b", "a")


@pytest.mark.parametrize("n", [0, 1, 2])
def test_fewer_than_three_providers_refused(n):
    with pytest.raises(CalibrationError, match="at least 3 providers"):
        calibrate({f"p{i}": {"t": 1e-3} for i in range(n)}, 0.0, reference_manifest_sha=SHA)


def test_mismatched_tensor_sets_name_the_missing_tensors():
    errors = {"a": {"t": 1e-3, "u": 1e-3}, "b": {"t": 1e-3}, "c": {"u": 1e-3, "t": 1e-3}}
    with pytest.raises(CalibrationError, match="b lacks u"):
        calibrate(errors, 0.0, reference_manifest_sha=SHA)
    with pytest.raises(CalibrationError, match="no tensors"):
        calibrate({"a": {}, "b": {}, "c": {}}, 0.0, reference_manifest_sha=SHA)


def test_zero_error_others_infinite_factor_is_named():
    errors = {"a": {"t": 0.0, "grad/z": 1e-3}, "b": {"t": 0.0, "grad/z": 0.0}, "c": {"t": 1e-3, "grad/z": 0.0}}
    with pytest.raises(CalibrationError, match=r"infinite.*grad/z.*held out a"):
        calibrate(errors, 1e-5, reference_manifest_sha=SHA)
    # at or below the floor, zero-error others need no factor
    ok = calibrate({"a": {"t": 0.0}, "b": {"t": 0.0}, "c": {"t": 1e-6}}, 1e-5, reference_manifest_sha=SHA)
    assert ok.k == 1.0 and ok.leave_one_out["c"] == {"ratio": 0.0, "tensor": None, "twins": []}


def test_missing_tensors_and_ledger_fail_and_are_named():
    errors = {p: {"a": e, "b": e, "c": e} for p, e in (("x", 1e-3), ("y", 0.9e-3), ("z", 0.8e-3))}
    rule = calibrate(errors, 0.0, reference_manifest_sha=SHA)
    order = {"a": 2, "b": 0, "c": 1}
    v = verdict({"a": 1e-3, "c": 9.0, "extra": 1.0}, rule, order)
    assert not v.passed and v.missing == ("b",) and v.failures == ("b", "c") and v.ungated == ("extra",)
    assert "missing from the candidate: b" in summarize(v)
    v = verdict({"a": 1e-3, "b": 1e-3, "c": 1e-3}, rule, order, ledger_missing=["blocks.1.swiglu", "blocks.0.qkv"])
    assert not v.passed and not v.failures and v.ledger_missing == ("blocks.0.qkv", "blocks.1.swiglu")
    with pytest.raises(RuleError, match="without an execution order: c"):
        verdict({}, rule, {"a": 0, "b": 1})


def test_verdict_accepts_comparisons_and_records_single_provider_bounds():
    errors = {p: {"out/sample": e, "grad/w": e} for p, e in (("default", 1e-3), ("flash", 2e-3), ("cublaslt", 1.5e-3))}
    rule = calibrate(errors, 1e-5, reference_manifest_sha=SHA)
    bounds = single_provider_bounds(errors["default"], 1e-5)
    assert bounds["grad/w"] == SINGLE_PROVIDER_FACTOR * 1e-3 + 1e-5
    cand = {
        "out/sample": TensorComparison("out/sample", 1.8e-3, 0.5, 1.0, 1.8e-3, 0, 0, 10),
        "grad/w": TensorComparison("grad/w", 1e-3, 0.1, 1.0, 1e-3, 0, 0, 10),
    }
    v = verdict(cand, rule, {"out/sample": 0, "grad/w": 1}, single_bounds=bounds)
    assert v.passed and v.single_provider_passed is False and v.single_provider_failures == ("out/sample",)
    t = v.tensor("out/sample")
    assert t.kind == "out" and t.bound == ensemble_bound(rule.k, 2e-3, 1e-5) and t.ratio == 1.8e-3 / t.bound
    assert v.worst == "out/sample" and v.first_drift is None
    assert "single-provider record (not gating): fail" in summarize(v) and summarize(v).startswith("PASS")
    assert v.to_json() == verdict(cand, rule, {"out/sample": 0, "grad/w": 1}, single_bounds=bounds).to_json()


def test_rule_json_round_trip_is_exact_and_strict():
    errors = {"a": {"t": 0.1 + 0.2, "u": 1e-3}, "b": {"t": 0.3, "u": 2e-3}, "c": {"t": 0.25, "u": 3e-3}}
    rule = calibrate(errors, derive_floor(None), reference_manifest_sha=SHA, floor_method=floor_method(None))
    text = rule.to_json()
    json.loads(text, parse_constant=lambda s: pytest.fail(s))
    assert EnsembleRule.from_json(text) == rule and EnsembleRule.from_json(json.loads(text)) == rule
    assert set(json.loads(text)) == {
        "schema", "k", "k_raw", "floor", "floor_method", "providers", "leave_one_out",
        "max_provider_error", "reference_manifest_sha",
    }  # fmt: skip
    with pytest.raises(RuleError, match="schema"):
        EnsembleRule.from_json("{}")
    with pytest.raises(RuleError, match="finite"):
        dataclasses.replace(rule, floor=math.nan)


def test_derive_floor():
    assert derive_floor(None) == FLOOR_EPS_MULTIPLE * 2.0**-24
    assert derive_floor({"a": 3e-6, "b": 1e-7}) == FLOOR_NOISE_FACTOR * 3e-6
    assert derive_floor({"a": 0.0}) == FLOOR_MIN
    assert "worst a" in floor_method({"a": 3e-6, "b": 1e-7}) and floor_method(None).startswith("fp32-epsilon")
    for bad in ({}, {"a": math.nan}, {"a": -1.0}):
        with pytest.raises(RuleError):
            derive_floor(bad)


def test_spread():
    s = spread({"a": {"t": 1e-3, "z": 0.0}, "b": {"t": 4e-3, "z": 0.0}, "c": {"t": 2e-3, "z": 1e-4}})
    assert s["t"] == {
        "min": 1e-3,
        "max": 4e-3,
        "ratio": 4.0,
        "outlier": "b",
        "by_provider": {"a": 1e-3, "b": 4e-3, "c": 2e-3},
    }
    assert s["z"]["ratio"] == math.inf and s["z"]["outlier"] == "c"
    assert spread({"a": {"z": 0.0}, "b": {"z": 0.0}})["z"]["ratio"] == 1.0
    with pytest.raises(CalibrationError, match="b lacks t"):
        spread({"a": {"t": 1.0}, "b": {}})


def test_provider_report_and_thresholds():
    comps = [
        TensorComparison("fwd/b", 2e-3, 0.1, 1.0, 2e-3, 0, 0, 4),
        TensorComparison("fwd/a", math.inf, math.inf, 1.0, math.inf, 1, 0, 4),
    ]
    rep = provider_report("flash", comps, reference_run="ref1", provider_run="run2")
    assert rep == provider_report("flash", comps, reference_run="ref1", provider_run="run2")
    assert [t["name"] for t in rep["tensors"]] == ["fwd/b", "fwd/a"]  # the given (execution) order
    assert rep["summary"] == {"tensors": 2, "worst": "fwd/a", "worst_relative_l2": "inf", "nonfinite": ["fwd/a"]}
    assert {"provider", "reference_run", "provider_run", "schema"} <= set(rep)
    assert errors_from_report(json.loads(json.dumps(rep))) == {"fwd/b": 2e-3, "fwd/a": math.inf}
    with pytest.raises(RuleError, match="duplicate"):
        provider_report("flash", comps + comps[:1], reference_run="r", provider_run="p")
    th = thresholds_json({"fwd/b": 3e-3}, {"default": "ab" * 32}, floor=1e-5)
    assert th["bounds"] == {"fwd/b": 3e-3} and th["reports"] == {"default": "ab" * 32} and th["factor"] == 1.5
    with pytest.raises(RuleError, match="hashes"):
        thresholds_json({"fwd/b": 3e-3}, {})


def test_tensor_kind_and_empty_rule_refused():
    assert tensor_kind("grad/transformer_blocks.39.adaln_proj.linear.weight") == "grad"
    assert tensor_kind("bare") == ""
    rule = calibrate({"a": {"t": 1e-3}, "b": {"t": 2e-3}, "c": {"t": 3e-3}}, 0.0, reference_manifest_sha=SHA)
    with pytest.raises(RuleError, match="no tensors"):
        dataclasses.replace(rule, max_provider_error={})
