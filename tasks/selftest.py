"""Gate power: does the gate catch realistic kernel bugs, and does it pass what is correct?

``run_selftest(store, reference, rule, preset, checkpoint, device=, mutants=, seed=) -> SelfTest``, plain
functions, no Prefect:

1. baseline: the candidate as it is (no override). Recorded, not counted: if it fails, a mutant's "caught"
   says nothing about that mutant, and the self-test says so in ``findings``.
2. mutants (``tasks.mutants``): each bound through ``run_candidate(..., overrides=mutant.overrides())`` and
   judged by ``gate.decide`` (the ensemble-rule verdict stage; golden block-0 tests are not part of it).
   Per mutant: caught (verdict failed), the first failing tensor (execution order), first drift and its
   block, localised (first drift's block == the mutant's ``expect_block``), the worst tensor and ratio.
3. false-reject probes, each must pass:
   - ``held-out/<p>``: every provider of the rule held out in turn, its stored errors gated (``rules.verdict``)
     against ``rules.calibrate`` on the others with the rule's floor (needs >= 3 left, so >= 4 providers).
     Unlike the calibration's own leave-one-out, k is recalibrated without p: p is a provider the rule has
     never seen, as a new, correct candidate would be.
   - ``second-seed/<p>``: a fresh sample (``seed`` override): FP32, FP32-alt and every provider captured
     again; the default BF16 provider gated against a rule calibrated on the *other* providers of that
     sample, floor from that sample's FP32 noise. Honest because rule and candidate share a sample, as
     in real use, and the gated provider took no part in the rule. The same run gated against the
     seed-0 rule (per-tensor bounds of another input) is recorded as ``cross_sample``, informational
     only: per-tensor provider errors are properties of one input, and the gate never crosses inputs.
     The fresh runs are stored as runs; no ``refs/`` pointer is written (the current reference stays).
   - ``honest-alternative``: every transformer block's 12 nodes bound to ``mutants.honest_ops`` (fp32
     accumulation, softmax upcast, fused fp32 modulate, fp32 cos/sin), gated like a candidate.
   A rejected probe is a finding about the rule (``findings``, with the failing tensors), never hidden:
   nothing is loosened.
4. summary: detection rate (caught / mutants and over ``must_catch``), localisation rate (localised /
   caught), false-reject count, ``must_catch_escaped``. ``write_selftest`` stores ``selftest.json`` under
   ``runs/<reference_id>-selftest/`` and the HTML report (baseline verdict + a self-test section).
"""

from __future__ import annotations

import dataclasses
import html
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks import calibration, rules
from tasks import gate as gate_lib
from tasks import mutants as mutants_lib
from tasks.compare import canonical_json
from tasks.model import CheckpointRef, Preset, build_sample, write_sample
from tasks.providers import fp32_alt_provider, fp32_provider, provider_set
from tasks.reference import ReferenceInfo, capture_reference_run
from tasks.report_figures import block_of
from tasks.store import Store

SCHEMA = "h3gate.selftest/1"
SECOND_SEED = 1
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    """One gated thing (a mutant or a probe): its verdict in a few fields."""

    name: str
    passed: bool
    first_failing: str | None
    first_drift: str | None
    worst: str | None
    worst_ratio: float | None
    failures: tuple[str, ...]
    wall_s: float = 0.0

    @classmethod
    def of(cls, name: str, verdict: rules.Verdict, wall_s: float = 0.0) -> Outcome:
        worst = verdict.tensor(verdict.worst) if verdict.worst else None
        return cls(name, verdict.passed, verdict.failures[0] if verdict.failures else None, verdict.first_drift,
                   verdict.worst, worst.ratio if worst else None, verdict.failures, round(wall_s, 3))


@dataclass(frozen=True)
class MutantResult:
    mutant: mutants_lib.Mutant
    outcome: Outcome
    ledger_missing: tuple[str, ...]

    @property
    def caught(self) -> bool:
        return not self.outcome.passed

    @property
    def drift_block(self) -> str | None:
        return block_of(self.outcome.first_drift) if self.outcome.first_drift else None

    @property
    def localised(self) -> bool:
        return self.drift_block == (self.mutant.expect_block or self.mutant.block)

    def to_dict(self) -> dict[str, Any]:
        return {**self.mutant.to_dict(), **_outcome_dict(self.outcome), "caught": self.caught,
                "escaped_must_catch": self.mutant.must_catch and not self.caught, "drift_block": self.drift_block,
                "localised": self.localised, "ledger_missing": list(self.ledger_missing)}


@dataclass
class SelfTest:
    reference_id: str
    rule_sha: str
    k: float
    baseline: Outcome | None
    mutants: list[MutantResult]
    probes: list[Outcome]
    cross_sample: Outcome | None = None
    findings: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    baseline_verdict: dict[str, Any] | None = None  # the baseline's full verdict, for the HTML report (not in json)

    @property
    def must_catch_escaped(self) -> list[str]:
        return [m.mutant.name for m in self.mutants if m.mutant.must_catch and not m.caught]

    @property
    def false_rejects(self) -> list[str]:
        return [p.name for p in self.probes if not p.passed]

    def summary(self) -> dict[str, Any]:
        caught = [m for m in self.mutants if m.caught]
        must = [m for m in self.mutants if m.mutant.must_catch]
        return {
            "mutants": len(self.mutants),
            "caught": len(caught),
            "detection_rate": _rate(len(caught), len(self.mutants)),
            "must_catch": len(must),
            "must_catch_caught": sum(m.caught for m in must),
            "must_catch_detection_rate": _rate(sum(m.caught for m in must), len(must)),
            "must_catch_escaped": self.must_catch_escaped,
            "localised": sum(m.localised for m in caught),
            "localisation_rate": _rate(sum(m.localised for m in caught), len(caught)),
            "probes": len(self.probes),
            "false_rejects": len(self.false_rejects),
            "false_rejected": self.false_rejects,
            "baseline_passed": None if self.baseline is None else self.baseline.passed,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "reference_id": self.reference_id, "rule_sha": self.rule_sha, "k": self.k,
                "summary": self.summary(), "findings": list(self.findings),
                "baseline": None if self.baseline is None else _outcome_dict(self.baseline),
                "mutants": [m.to_dict() for m in self.mutants], "probes": [_outcome_dict(p) for p in self.probes],
                "cross_sample": None if self.cross_sample is None else _outcome_dict(self.cross_sample),
                "wall_s": round(self.wall_s, 3)}


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def _outcome_dict(o: Outcome) -> dict[str, Any]:
    d = dataclasses.asdict(o)
    d["failures"] = list(o.failures[:20])
    d["failure_count"] = len(o.failures)
    return d


# ------------------------------------------------------------------------------------------------ candidate runs


def gate_candidate(store: Store, reference: ReferenceInfo, rule: calibration.RuleFiles, preset: Preset,
                   checkpoint: CheckpointRef, *, device: str, name: str,
                   overrides: Mapping[tuple[str, str], Any] | None = None) -> tuple[Outcome, tuple[str, ...]]:
    """One bound candidate run (with `overrides`) and its ensemble-rule verdict."""
    started = time.perf_counter()
    run = gate_lib.run_candidate(store, reference, preset, checkpoint, device=device, overrides=overrides)
    verdict = gate_lib.decide(store, rule, run)
    return Outcome.of(name, verdict, time.perf_counter() - started), verdict.ledger_missing


def run_mutant(store: Store, reference: ReferenceInfo, rule: calibration.RuleFiles, preset: Preset,
               checkpoint: CheckpointRef, mutant: mutants_lib.Mutant, *, device: str) -> MutantResult:
    """One mutant through the gate. A run that raises (the gate errors out, exit 2) counts as caught, with why."""
    try:
        outcome, missing = gate_candidate(store, reference, rule, preset, checkpoint, device=device,
                                          name=mutant.name, overrides=mutant.overrides())
    except Exception as exc:  # noqa: BLE001 - a gate error rejects the candidate; the message is recorded
        error = f"gate error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return MutantResult(mutant, Outcome(mutant.name, False, error, None, None, None, (error,)), ())
    return MutantResult(mutant, outcome, missing)


def honest_alternative(store: Store, reference: ReferenceInfo, rule: calibration.RuleFiles, preset: Preset,
                       checkpoint: CheckpointRef, *, device: str) -> Outcome:
    blocks = [f"transformer_blocks.{i}" for i in range(int(preset.config["num_layers"]))]
    return gate_candidate(store, reference, rule, preset, checkpoint, device=device, name="honest-alternative",
                          overrides=mutants_lib.honest_ops(blocks))[0]


# ------------------------------------------------------------------------------------------------ provider probes


def _gate_errors(name: str, errors: Mapping[str, float], rule: rules.EnsembleRule, order: Mapping[str, int]
                 ) -> Outcome:
    return Outcome.of(name, rules.verdict(dict(errors), rule, order))


def held_out(reports: calibration.ReportSet, rule: rules.EnsembleRule, prefix: str = "held-out") -> list[Outcome]:
    """Each provider gated against a rule recalibrated on the others (same floor); [] with < 4 providers."""
    providers = sorted(reports.errors)
    if len(providers) <= rules.MIN_PROVIDERS:
        return []
    out = []
    for p in providers:
        others = {q: reports.errors[q] for q in providers if q != p}
        without = rules.calibrate(others, rule.floor, reference_manifest_sha=rule.reference_manifest_sha,
                                  floor_method=rule.floor_method)
        out.append(_gate_errors(f"{prefix}/{p}", reports.errors[p], without, reports.order))
    return out


def second_seed(store: Store, reference: ReferenceInfo, rule: rules.EnsembleRule, preset: Preset,
                checkpoint: CheckpointRef, *, device: str, seed: int = SECOND_SEED) -> tuple[Outcome, Outcome]:
    """(the default provider of a fresh sample against that sample's rule without it, the same against `rule`)."""
    fresh = dataclasses.replace(preset, sample=dataclasses.replace(preset.sample, seed=seed))
    sample_sha = write_sample(store, build_sample(fresh.config, fresh.sample))

    def capture(provider: Any, dtype: str) -> str:
        return capture_reference_run(store, fresh, checkpoint, sample_sha, provider, dtype, device).run_id

    fp32 = capture(fp32_provider(device), "float32")
    noise = _errors(store, capture(fp32_alt_provider(device), "float32"), fp32, device)
    errors = {name: _errors(store, capture(p, "bfloat16"), fp32, device) for name, p in provider_set(device).items()
              if name in reference.provider_runs}
    default = reference.default_provider
    others = {p: e for p, e in errors.items() if p != default}
    fresh_rule = rules.calibrate(others, rules.derive_floor(noise), reference_manifest_sha=store.manifest_sha(fp32),
                                 floor_method=rules.floor_method(noise))
    manifest = store.read_manifest(fp32)
    order = {n: manifest["tensors"][n]["order"] for n in calibration.gated_names(manifest)}
    return (_gate_errors(f"second-seed/{default}", errors[default], fresh_rule, order),
            _gate_errors(f"cross-sample/{default}", errors[default], rule, order))


def _errors(store: Store, run: str, fp32: str, device: str) -> dict[str, float]:
    return {c.name: c.relative_l2 for c in calibration.compare_stored_runs(store, [run], fp32, device=device)[run]}


# ------------------------------------------------------------------------------------------------ the self-test


def run_selftest(store: Store, reference: ReferenceInfo, rule: calibration.RuleFiles, preset: Preset,
                 checkpoint: CheckpointRef, *, device: str, mutants: Iterable[mutants_lib.Mutant] | None = None,
                 seed: int | None = SECOND_SEED, honest: bool = True, baseline: bool = True,
                 progress: Progress | None = None) -> SelfTest:
    """Baseline, every mutant, the false-reject probes; see the module docstring."""
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    chosen = list(mutants_lib.library(preset.config) if mutants is None else mutants)
    result = SelfTest(reference.reference_id, rule.rule_sha, rule.rule.k, None, [], [])
    if baseline:
        started_run = time.perf_counter()
        run = gate_lib.run_candidate(store, reference, preset, checkpoint, device=device)
        verdict = gate_lib.decide(store, rule, run)
        result.baseline = Outcome.of("baseline", verdict, time.perf_counter() - started_run)
        result.baseline_verdict = json.loads(verdict.to_json())
        say(f"baseline candidate: {'PASS' if result.baseline.passed else 'FAIL'}")
    for mutant in chosen:
        m = run_mutant(store, reference, rule, preset, checkpoint, mutant, device=device)
        result.mutants.append(m)
        say(f"mutant {mutant.name}: {'caught' if m.caught else 'ESCAPED'} (worst ratio {_g(m.outcome.worst_ratio)}, "
            f"first drift {m.outcome.first_drift})")
    result.probes += held_out(calibration.provider_reports(store, reference, device=device), rule.rule)
    if seed is not None:
        fresh, cross = second_seed(store, reference, rule.rule, preset, checkpoint, device=device, seed=seed)
        result.probes.append(fresh)
        result.cross_sample = cross
    if honest:
        result.probes.append(honest_alternative(store, reference, rule, preset, checkpoint, device=device))
    for probe in result.probes:
        say(f"probe {probe.name}: {'pass' if probe.passed else 'REJECTED'} (worst ratio {_g(probe.worst_ratio)})")
    result.findings = findings(result)
    result.wall_s = time.perf_counter() - started
    return result


def findings(result: SelfTest) -> list[str]:
    """What the self-test says loudly: a failing baseline, rejected correct implementations, escaped mutants."""
    out = []
    if result.baseline is not None and not result.baseline.passed:
        out.append(f"BASELINE FAILS: the candidate itself fails ({len(result.baseline.failures)} tensors, first "
                   f"{result.baseline.first_failing}); mutant detection says nothing about the gate's power")
    for p in result.probes:
        if not p.passed:
            out.append(f"RULE REJECTS A CORRECT IMPLEMENTATION: {p.name} fails on {len(p.failures)} tensors "
                       f"({', '.join(p.failures[:8])}); worst {p.worst} at {_g(p.worst_ratio)} x its bound. "
                       "This is a finding about the rule, not loosened here.")
    for name in result.must_catch_escaped:
        m = next(x for x in result.mutants if x.mutant.name == name)
        out.append(f"MUST-CATCH MUTANT ESCAPED: {name} ({m.mutant.description}); worst {m.outcome.worst} at "
                   f"{_g(m.outcome.worst_ratio)} x its bound")
    return out


def write_selftest(store: Store, result: SelfTest) -> tuple[str, str]:
    """selftest.json under runs/<reference_id>-selftest/; returns (run id, sha256)."""
    run_id = f"{result.reference_id}-selftest"
    doc = json.loads(canonical_json(result.to_dict()))
    return run_id, store.write_document(run_id, "selftest.json", doc).sha256


def selftest_html(result: SelfTest) -> str:
    """The report section: summary, findings, one row per mutant and per probe (trusted markup, escaped text)."""
    sm = result.summary()

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.0f}%"

    head = (f"<p><b>Detection</b> {sm['caught']}/{sm['mutants']} ({pct(sm['detection_rate'])}); must-catch "
            f"{sm['must_catch_caught']}/{sm['must_catch']} ({pct(sm['must_catch_detection_rate'])}); "
            f"<b>localisation</b> {sm['localised']}/{sm['caught']} ({pct(sm['localisation_rate'])}); "
            f"<b>false rejects</b> {sm['false_rejects']}/{sm['probes']}; rule k = {result.k:.4g}</p>")
    found = "".join(f"<li class='no'>{_esc(f)}</li>" for f in result.findings)
    head += f"<ul>{found}</ul>" if found else "<p>No findings: every must-catch mutant caught, no probe rejected.</p>"
    rows = "".join(
        f"<tr{' class=f' if m.mutant.must_catch and not m.caught else ''}><td><code>{_esc(m.mutant.name)}</code></td>"
        f"<td>{_esc(m.mutant.block)}/{_esc(m.mutant.node)}</td><td>{_esc(m.mutant.description)}</td>"
        f"<td>{'yes' if m.mutant.must_catch else 'no'}</td><td>{'caught' if m.caught else 'escaped'}</td>"
        f"<td class='n'>{_g(m.outcome.worst_ratio)}</td><td><code>{_esc(m.outcome.first_failing or '')}</code></td>"
        f"<td><code>{_esc(m.outcome.first_drift or '')}</code></td><td>{'yes' if m.localised else 'no'}</td></tr>"
        for m in result.mutants)
    mutants = ("<table><tr><th>mutant</th><th>node</th><th>bug</th><th>must catch</th><th>result</th>"
               "<th class=n>worst ratio</th><th>first failing</th><th>first drift</th><th>localised</th></tr>"
               f"{rows}</table>")
    extra = [result.cross_sample] if result.cross_sample is not None else []
    prow = "".join(
        f"<tr{' class=f' if not p.passed and p in result.probes else ''}><td><code>{_esc(p.name)}</code></td>"
        f"<td>{'pass' if p.passed else 'REJECTED'}{'' if p in result.probes else ' (informational)'}</td>"
        f"<td class='n'>{_g(p.worst_ratio)}</td><td><code>{_esc(p.worst or '')}</code></td>"
        f"<td>{_esc(', '.join(p.failures[:6]))}</td></tr>" for p in [*result.probes, *extra])
    probes = ("<h3>Correct implementations (false-reject probes)</h3><table><tr><th>probe</th><th>result</th>"
              f"<th class=n>worst ratio</th><th>worst</th><th>failing tensors</th></tr>{prow}</table>")
    return head + mutants + probes


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


__all__ = ["MutantResult", "Outcome", "SelfTest", "findings", "gate_candidate", "held_out",
           "honest_alternative", "run_mutant", "run_selftest", "second_seed", "selftest_html", "write_selftest"]
