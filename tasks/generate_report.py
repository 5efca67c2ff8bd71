"""The generation gate's report: the drift report of ``tasks.report`` plus the trajectory sections.

``generate_sections(doc)`` -> [(title, plotly figure | HTML fragment)] for ``report.build_report(extra_sections=)``:
per-step velocity error curves (candidate and every provider, video and audio side by side, the ensemble bound
dashed, log y), final-latent metrics (candidate and providers: relative L2, max abs, PSNR, cosine) and the
determinism check. ``build_generate_report(outcome)`` is the whole page; ``step_table(doc)`` the rows of the
per-step table artifact. Inputs are ``GenerateOutcome`` / generate.json dicts only, so the report can be rebuilt
from the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tasks.report import build_report
from tasks.report_figures import CAND_COLOUR, FAIL_COLOUR, PROVIDER_COLOURS, esc, fmt, num

MODALITIES = ("video", "audio")


def step_figure(doc: Mapping[str, Any]) -> go.Figure:
    """Per-step relative L2 of the velocities against the FP32 trajectory: candidate, providers, bound."""
    rows = doc.get("steps", [])
    steps = [r["step"] for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("video velocity", "audio velocity"), shared_yaxes=True)
    providers = sorted(rows[0]["video_providers"]) if rows else []
    for col, modality in enumerate(MODALITIES, 1):
        first = col == 1
        for j, provider in enumerate(providers):
            fig.add_trace(go.Scatter(x=steps, y=[num(r[f"{modality}_providers"][provider]) for r in rows],
                                     mode="lines", name=provider, legendgroup=provider, showlegend=first,
                                     line={"color": PROVIDER_COLOURS[j % len(PROVIDER_COLOURS)], "width": 1}),
                          row=1, col=col)
        fig.add_trace(go.Scatter(x=steps, y=[num(r[f"{modality}_bound"]) for r in rows], mode="lines",
                                 name="bound (k × max provider + floor)", legendgroup="bound", showlegend=first,
                                 line={"color": FAIL_COLOUR, "dash": "dash", "width": 1}), row=1, col=col)
        fig.add_trace(go.Scatter(x=steps, y=[num(r[f"{modality}_error"]) for r in rows], mode="lines+markers",
                                 name="candidate", legendgroup="candidate", showlegend=first,
                                 line={"color": CAND_COLOUR, "width": 2.5}), row=1, col=col)
        failing = [r for r in rows if num(r[f"{modality}_ratio"]) > 1]
        if failing:
            fig.add_trace(go.Scatter(x=[r["step"] for r in failing], y=[num(r[f"{modality}_error"]) for r in failing],
                                     mode="markers", name="over the bound", legendgroup="fail", showlegend=first,
                                     marker={"color": FAIL_COLOUR, "symbol": "x", "size": 11}), row=1, col=col)
        fig.update_xaxes(title_text="step (model evaluation)", row=1, col=col)
    fig.update_yaxes(type="log", title_text="relative L2 vs FP32 trajectory", row=1, col=1)
    fig.update_layout(height=420, margin={"l": 60, "r": 20, "t": 40, "b": 50}, template="plotly_white",
                      legend={"orientation": "h", "y": -0.2})
    return fig


def final_table(doc: Mapping[str, Any]) -> str:
    """Final-latent metrics of the candidate and every provider against the FP32 trajectory (HTML)."""
    head = "<tr><th>trajectory</th><th>tensor</th><th class=n>relative L2</th><th class=n>max abs</th>" \
           "<th class=n>PSNR (dB)</th><th class=n>cosine</th></tr>"
    body = ""
    for who, metrics in (("candidate", doc.get("final", {})), *sorted(doc.get("provider_final", {}).items())):
        for name, m in sorted(metrics.items()):
            body += (f"<tr><td>{'<b>candidate</b>' if who == 'candidate' else esc(who)}</td><td><code>{esc(name)}"
                     f"</code></td><td class=n>{fmt(m['relative_l2'])}</td><td class=n>{fmt(m['max_abs'])}</td>"
                     f"<td class=n>{fmt(m['psnr_db'], '.2f')}</td><td class=n>{fmt(m['cosine'], '.8f')}</td></tr>")
    return (f"<p class='note'>Target rows after the last of {doc.get('model_evaluations')} model evaluations "
            f"({doc.get('num_steps')} schedule points). PSNR peak = max − min of the FP32 latents.</p>"
            f"<table>{head}{body}</table>")


def determinism_html(doc: Mapping[str, Any]) -> str:
    """The determinism check: two candidate trajectories byte-equal after every evaluation and update?"""
    det = doc.get("determinism", {})
    if det.get("deterministic"):
        return (f"<p><span class='ok'>deterministic</span>: two candidate trajectories byte-equal at all "
                f"{det.get('events')} events (every model output and every Euler update).</p>")
    miss = det.get("first_mismatch") or {}
    return (f"<p><span class='no'>NOT deterministic</span>: the two candidate trajectories first differ at step "
            f"{esc(miss.get('step'))}, <code>{esc(miss.get('tensor'))}</code>.</p>")


def summary_html(doc: Mapping[str, Any]) -> str:
    w = doc.get("worst_step")
    facts = [("Result", "<span class='ok'>PASS</span>" if doc.get("passed") else "<span class='no'>FAIL</span>"),
             ("Numerical rule", "pass" if doc.get("numerically_passed") else "fail"),
             ("First failure", f"<code>{esc(doc.get('first_failure'))}</code>" if doc.get("first_failure") else "none"),
             ("Worst step", f"<code>{esc(w['tensor'])}</code> at {fmt(w['ratio'])} × its bound" if w else "n/a"),
             ("Numerical gate", f"<code>{esc(doc.get('gate_id'))}</code>")]
    return "<dl>" + "".join(f"<dt>{a}</dt><dd>{b}</dd>" for a, b in facts) + "</dl>"


def generate_sections(doc: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [("Generation gate", summary_html(doc)), ("Velocity error per step", step_figure(doc)),
            ("Final latents", final_table(doc)), ("Determinism", determinism_html(doc))]


def step_table(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per-step rows (candidate error, bound, ratio per modality) for a Prefect table artifact."""
    return [{k: v for k, v in r.items() if not k.endswith("_providers")} for r in doc.get("steps", [])]


def build_generate_report(outcome: Any) -> str:
    """The self-contained HTML page: the drift report of the trajectory tensors plus the sections above."""
    doc = outcome.doc
    verdict = dict(outcome.verdict, passed=doc["passed"])
    identity = {"title": f"h3gate generation gate · {doc['preset']} · {doc['num_steps']} steps",
                "preset": doc["preset"], "device": doc["device"], "generate id": doc["generate_id"],
                "numerical gate": doc["gate_id"], "reference": doc["reference_id"], "checkpoint": doc["checkpoint"],
                "conditioning sha256": doc["conditioning"],
                "candidate sources sha256": doc["candidate"].get("h3kernels_sha256"),
                "overrides": doc["overrides"] or "none", "deterministic": doc["determinism"]["deterministic"]}
    return build_report(verdict, outcome.provider_errors, outcome.rule, identity,
                        extra_sections=generate_sections(doc))
