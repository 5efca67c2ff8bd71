"""Diagnose results for people: report sections (HTML fragments, a Plotly figure), a markdown summary, a table.

All take the diagnose.json document (``tasks.diagnose``) and nothing else, so a stored document renders the same.
``sections(doc)`` -> [(title, html | figure)] for ``tasks.report.build_report(extra_sections=...)``;
``markdown(doc, report_url)`` the summary artifact; ``table_rows(doc)`` one row per configuration run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tasks.report_figures import esc, fmt


def _verdict(s: Mapping[str, Any]) -> str:
    return "pass" if s.get("passed") else "FAIL"


def table_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every configuration run, in the order it ran: what was replaced and its verdict summary."""
    steps = {s["label"]: s for s in (doc.get("localisation") or {}).get("steps", [])}
    return [{"run": i, "configuration": r["label"], "stage": steps.get(r["label"], {}).get("stage", ""),
             "replaced_nodes": r["replaced"], "provider": r["provider"] or "default", "verdict": _verdict(r),
             "worst_ratio": fmt(r["worst_ratio"], ".4g"), "failing": r["failing"], "worst": r["worst"],
             "first_drift": r["first_drift"]} for i, r in enumerate(doc.get("runs", []))]


def _localisation_text(loc: Mapping[str, Any] | None) -> str:
    if not loc:
        return "not requested (--auto)"
    if not loc.get("found"):
        return f"nothing localised: {loc.get('why')}"
    return (f"{', '.join(loc['nodes'])} (groups {', '.join(loc['groups'])}) in {', '.join(loc['blocks'])}: "
            f"replacing them takes the worst ratio from {fmt(loc['baseline_ratio'])} to "
            f"{fmt(loc['steps'][-1]['worst_ratio']) if loc['steps'] else 'n/a'} ({loc['mode']})")


def markdown(doc: Mapping[str, Any], report_url: str | None) -> str:
    b = doc["baseline"]
    lines = [f"## h3gate diagnose: {esc(doc['reference_id'])}", "",
             f"- **Baseline candidate:** {_verdict(b)}, worst ratio {fmt(b['worst_ratio'])} (`{b['worst']}`), "
             f"{b['failing']} failing, first drift `{b['first_drift']}`",
             f"- **Localisation:** {_localisation_text(doc.get('localisation'))}"]
    for block in doc.get("isolation", []):
        creators = [n["node"] for n in block["nodes"] if n["creates"]]
        lines.append(f"- **Isolation {block['block']}:** " + (f"creates error: {', '.join(creators)}" if creators
                                                             else "no node creates error; it carries it"))
    lines += ["", "| configuration | provider | verdict | worst ratio | failing | first drift |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['configuration']} | {r['provider']} | {r['verdict']} | {r['worst_ratio']} | {r['failing']} | "
              f"`{r['first_drift']}` |" for r in table_rows(doc)]
    return "\n".join(lines + (["", f"[Report]({report_url})"] if report_url else [])) + "\n"


def _runs_html(doc: Mapping[str, Any]) -> str:
    cols = ("run", "configuration", "stage", "replaced_nodes", "provider", "verdict", "worst_ratio", "failing",
            "first_drift")
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in cols)
    body = "".join("<tr" + (" class=f" if r["verdict"] == "FAIL" else "") + ">"
                   + "".join(f"<td>{esc(r[c])}</td>" for c in cols) + "</tr>" for r in table_rows(doc))
    return (f"<p><b>Localisation:</b> {esc(_localisation_text(doc.get('localisation')))}</p>"
            f"<table><tr>{head}</tr>{body}</table><p class='note'>Replaced nodes run diffusers' own op "
            "(REFERENCE_OPS); each row is one full forward+backward of the bound BF16 model judged by the gate's "
            "ensemble rule.</p>")


def _isolation_html(doc: Mapping[str, Any]) -> str:
    out = []
    for block in doc.get("isolation", []):
        inh, car = block.get("inherited") or {}, block["carried_out"]
        out.append(f"<h3>{esc(block['block'])}</h3><p>In the chain: error on its input {fmt(inh.get('relative_l2'))} "
                   f"(largest provider {fmt(inh.get('max_provider_error'))}), on its output "
                   f"{fmt(car['relative_l2'])} (largest provider {fmt(car['max_provider_error'])}).</p>")
        rows = "".join(f"<tr{' class=f' if n['creates'] else ''}><td><code>{esc(n['node'])}</code></td>"
                       f"<td>{esc(n['tensor'])}</td><td>{fmt(n['isolated'])}</td><td>{fmt(n['reference_bf16'])}</td>"
                       f"<td>{fmt(n['ratio'])}</td><td>{'creates' if n['creates'] else 'carries'}</td></tr>"
                       for n in block["nodes"])
        out.append("<table><tr><th>node</th><th>worst tensor</th><th>isolated candidate</th><th>isolated BF16 "
                   f"reference</th><th>ratio</th><th>error</th></tr>{rows}</table>")
    return "".join(out) + ("<p class='note'>Isolated: each node on the FP32 reference's exact inputs of this block; "
                           "'creates' = over the golden limit (2 x BF16 reference + floor).</p>")


def conditioning_figure(doc: Mapping[str, Any]) -> go.Figure:
    rows = doc.get("conditioning", [])
    x = [r["block"] for r in rows]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("max logit", "mean softmax entropy / log S",
                                                        "dq/dk/dv change / 2^-8 input noise"))
    fig.add_trace(go.Bar(x=x, y=[r["max_logit"] for r in rows], name="max logit"), 1, 1)
    fig.add_trace(go.Bar(x=x, y=[r["mean_entropy"] / r["log_s"] for r in rows], name="entropy / log S"), 1, 2)
    for what in ("dq", "dk", "dv"):
        fig.add_trace(go.Scatter(x=x, y=[r[f"amplification_{what}"] for r in rows], mode="lines+markers",
                                 name=what), 1, 3)
    fig.update_layout(height=420, margin=dict(l=40, r=20, t=50, b=120), legend=dict(orientation="h"))
    return fig


def sections(doc: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("Diagnose: replacement configurations", _runs_html(doc))]
    if doc.get("isolation"):
        out.append(("Diagnose: isolated vs inherited error", _isolation_html(doc)))
    if doc.get("conditioning"):
        out.append(("Diagnose: attention conditioning (FP32 reference)", conditioning_figure(doc)))
    return out
