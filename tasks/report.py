"""The drift report of one gate run: a self-contained HTML page, a markdown verdict, Prefect artifacts.

Contract
--------
Inputs are plain JSON-able dicts, so a report can be rebuilt from the store alone:
``verdict`` (``rules.Verdict.to_dict()``), ``provider_errors`` ({provider: {tensor: relative_l2}}),
``rule`` (``EnsembleRule.to_dict()``) and ``identity`` (any {key: value}, rendered in the given order).
Non-finite floats may be the strings "inf"/"-inf"/"nan" (``compare.parse_float``).

``build_report(...) -> str`` is one HTML document with plotly.js embedded exactly once (a ``<script>``
in ``<head>``; every figure is a div drawn by an inline ``Plotly.newPlot``). No CDN, no ``src=``/
``href=`` to the network, no fonts or images fetched: it renders offline. Equal inputs give equal
bytes (fixed div ids, no timestamps of its own). Sections: 1 verdict header (PASS/FAIL, counts,
worst tensor and its ratio to its bound, first drift, single-provider record, missing ledger nodes,
identity table); 2 error per tensor in execution order (candidate, each provider, the ensemble bound;
log y; first drift and failures marked); 3 worst ratio per (block, kind) heatmap; 4 leave-one-out
calibration ratios against k; 5 the 20 worst tensors; then ``extra_sections``: (title, content) where
content is an HTML fragment (``str``, trusted markup from our own code) or a plotly figure (anything
with ``to_plotly_json``).

Redaction: every string taken from the inputs (keys too, extra fragments and figure text included)
goes through ``redact`` (default ``default_redactor()``: the home directory becomes ``~``, the host
name ``<host>``, URL userinfo ``***@``); identity values under secret-looking keys (token, secret,
password, credential, api/access/private key) become ``***``. Pass ``redact=lambda s: s`` to turn the
text hook off. The plotly.js bundle itself is never rewritten.

``store_report`` writes the HTML as a blob and as ``runs/<run_id>/report.html`` (local: temp file,
fsync, ``os.replace``; object stores: one PUT, atomic per object) and returns (``store.url``-based
URL without credentials, sha256). ``publish_artifacts`` (Prefect imported lazily) creates the
markdown verdict, the worst-tensor table and the report link under keys ``<key_prefix>-verdict``,
``<key_prefix>-worst-tensors``, ``<key_prefix>-report``; call it inside a flow or task.
"""

from __future__ import annotations

import html
import math
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import plotly.graph_objects as go
from fsspec.implementations.local import LocalFileSystem
from plotly.offline import get_plotlyjs

from tasks.compare import json_float, parse_float
from tasks.store import validate_name

Redact = Callable[[str], str]
Section = tuple[str, Any]  # (title, HTML fragment str | plotly figure)

KIND_ORDER = ("out", "dinput", "grad", "fwd", "bwd", "in")
FORWARD_KINDS = {"fwd", "in", "out"}
WORST_N = 20
PASS_COLOUR, FAIL_COLOUR, DRIFT_COLOUR, CAND_COLOUR = "#1a7f37", "#cf222e", "#d4a017", "#0b3d91"
PROVIDER_COLOURS = ("#7f8c8d", "#8e6cc1", "#2a9d8f", "#e07a5f", "#3d5a80", "#b5838d")
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
_BLOCK_RE = re.compile(r"^((?:\w+\.)*?\w*blocks\.\d+)(?=\.|$)")
_SECRET_KEY_RE = re.compile(r"secret|token|passw|credential|(api|access|private)[_ -]?key", re.I)
_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]*@")
_KEY_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
# Ratio heatmap colours live on log10(ratio) in [-2, 1]: ratio 1 (the bound) sits at 2/3, with a hard
# break there so every failing cell is red-orange and every passing one blue-to-amber.
_HEAT_LO, _HEAT_HI = -2.0, 1.0
_HEAT_SCALE = [[0.0, "#f7fbff"], [0.45, "#c6dbef"], [0.615, "#4a84c4"], [0.655, "#f2c14e"], [0.6666, "#f2a03d"],
               [0.6667, "#e8590c"], [1.0, "#99000d"]]  # 0.615: ratio 0.7, 0.655: ratio 0.9


# -- redaction and numbers ------------------------------------------------------------------------


def default_redactor(home: str | None = None, hostname: str | None = None) -> Redact:
    """Home directory -> ``~``, host name (and its first label) -> ``<host>``, URL userinfo -> ``***@``."""
    home = os.path.expanduser("~") if home is None else home
    host = socket.gethostname() if hostname is None else hostname
    # Names under 3 characters would match inside ordinary words; "localhost" says nothing about the machine.
    hosts = sorted({h for h in (host, host.split(".")[0]) if len(h) >= 3 and h != "localhost"}, key=len, reverse=True)
    home_re = re.compile(re.escape(home.rstrip("/")) + r"(?![\w.-])") if home.rstrip("/") else None
    host_res = [re.compile(rf"(?<![A-Za-z0-9]){re.escape(h)}(?![A-Za-z0-9])", re.I) for h in hosts]

    def redact(text: str) -> str:
        text = _USERINFO_RE.sub(r"\1***@", text)
        if home_re is not None:
            text = home_re.sub("~", text)
        for r in host_res:
            text = r.sub("<host>", text)
        return text

    return redact


def _redact_tree(obj: Any, redact: Redact, *, mask_secrets: bool = False) -> Any:
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {
            redact(str(k)): "***" if mask_secrets and _SECRET_KEY_RE.search(str(k)) and v is not None
            else _redact_tree(v, redact, mask_secrets=mask_secrets)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_redact_tree(v, redact, mask_secrets=mask_secrets) for v in obj]
    return obj


def _num(x: Any) -> float:
    """A verdict number as float (None -> nan; "inf"/"nan" strings parsed)."""
    return math.nan if x is None else parse_float(x)


def _fmt(x: Any, spec: str = ".3g") -> str:
    v = _num(x)
    return "n/a" if math.isnan(v) else ("inf" if math.isinf(v) else format(v, spec))


def _ratio_key(t: Mapping[str, Any]) -> float:
    r = _num(t.get("ratio"))
    return math.inf if math.isnan(r) else r  # an unknown ratio never hides below a known one


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


# -- tables ---------------------------------------------------------------------------------------


def worst_rows(verdict: Mapping[str, Any], n: int = WORST_N) -> list[dict[str, Any]]:
    """The ``n`` compared tensors with the largest ratio to their bound (ties: execution order), JSON-able."""
    ranked = sorted(verdict.get("tensors", ()), key=lambda t: (-_ratio_key(t), t["order"], t["name"]))[:n]

    def sig(x: Any) -> float | str | None:
        return None if x is None else json_float(float(f"{_num(x):.4g}"))

    return [
        {"rank": i, "tensor": t["name"], "kind": t["kind"], "order": t["order"], "ratio": sig(t["ratio"]),
         "relative_l2": sig(t["relative_l2"]), "bound": sig(t["bound"]),
         "max_provider_error": sig(t["max_provider_error"]), "max_abs": sig(t.get("max_abs")),
         "passed": bool(t["passed"]), "drift": bool(t["drift"])}
        for i, t in enumerate(ranked, 1)
    ]


def block_of(name: str) -> str:
    """Heatmap row of a tensor: its block ("transformer_blocks.12", "token_refiner.refiner_blocks.0"),
    else its top-level module ("proj_in"); model outputs are "output", input gradients "input"."""
    kind, _, rest = name.partition("/")
    if not rest:
        return "(other)"
    if kind == "out":
        return "output"
    if kind == "dinput":
        return "input"
    module = rest.split("/", 1)[0]  # in/<module>/<arg>
    m = _BLOCK_RE.match(module)
    return m.group(1) if m else module.split(".", 1)[0]


# -- figures --------------------------------------------------------------------------------------


def _layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    kw = {"margin": {"l": 70, "r": 30, "t": 40, "b": 60}, **kw}
    fig.update_layout(height=height, template="plotly_white", hoverlabel={"font": {"family": "ui-monospace"}},
                      font={"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}, **kw)
    return fig


def error_figure(verdict: Mapping[str, Any], provider_errors: Mapping[str, Mapping[str, float]]) -> go.Figure:
    """Candidate, provider and bound error per tensor against execution order (log y)."""
    ts = sorted(verdict.get("tensors", ()), key=lambda t: t["order"])
    finite = [v for t in ts for v in (_num(t["relative_l2"]), _num(t["bound"])) if math.isfinite(v) and v > 0]
    finite += [v for e in provider_errors.values() for v in map(_num, e.values()) if math.isfinite(v) and v > 0]
    lo, hi = (min(finite) / 3, max(finite) * 5) if finite else (1e-8, 1.0)

    def y(v: Any) -> float:  # zero sits on the bottom edge and non-finite on the top edge of the axis
        v = _num(v)
        return hi if not math.isfinite(v) else (lo if v <= 0 else v)

    fig = go.Figure()
    hover = "%{customdata[0]}<br>order %{x}<br>%{customdata[1]}<extra>%{fullData.name}</extra>"
    for i, (p, errs) in enumerate(sorted(provider_errors.items())):
        pts = [(t["order"], errs[t["name"]], t["name"]) for t in ts if t["name"] in errs]
        fig.add_scatter(x=[o for o, _, _ in pts], y=[y(e) for _, e, _ in pts], mode="markers", name=f"provider {p}",
                        marker={"size": 5, "opacity": 0.55, "color": PROVIDER_COLOURS[i % len(PROVIDER_COLOURS)]},
                        customdata=[[n, f"relative L2 {_fmt(e)}"] for _, e, n in pts], hovertemplate=hover)
    fig.add_scatter(x=[t["order"] for t in ts], y=[y(t["bound"]) for t in ts], mode="lines+markers",
                    name="ensemble bound", line={"color": "rgba(34,34,34,0.3)", "width": 1},
                    marker={"symbol": "line-ew", "size": 11, "line": {"width": 2, "color": "#222"}},
                    customdata=[[t["name"], f"bound {_fmt(t['bound'])}"] for t in ts], hovertemplate=hover)
    groups = (("candidate", CAND_COLOUR, "circle", 6, lambda t: t["passed"] and not t["drift"]),
              ("candidate, above every provider", DRIFT_COLOUR, "diamond", 8, lambda t: t["passed"] and t["drift"]),
              ("candidate, FAIL", FAIL_COLOUR, "x", 11, lambda t: not t["passed"] and math.isfinite(_num(t["ratio"]))),
              ("candidate, non-finite (top edge)", FAIL_COLOUR, "triangle-up", 12,
               lambda t: not t["passed"] and not math.isfinite(_num(t["ratio"]))))
    for name, colour, symbol, size, keep in groups:
        sel = [t for t in ts if keep(t)]
        fig.add_scatter(x=[t["order"] for t in sel], y=[y(t["relative_l2"]) for t in sel], mode="markers",
                        name=name, marker={"color": colour, "symbol": symbol, "size": size,
                                           "line": {"width": 1, "color": colour if symbol == "x" else "white"}},
                        customdata=[[t["name"], f"relative L2 {_fmt(t['relative_l2'])} · bound {_fmt(t['bound'])}"
                                     f" · ratio {_fmt(t['ratio'])}"] for t in sel], hovertemplate=hover)
    back = [t["order"] for t in ts if t["kind"] not in FORWARD_KINDS]
    if back and ts:
        fig.add_vrect(x0=min(back) - 0.5, x1=ts[-1]["order"] + 0.5, fillcolor="#6b7b8c", opacity=0.06, line_width=0,
                      annotation_text="backward", annotation_position="top left")
    drift = verdict.get("first_drift")
    if drift:
        fig.add_vline(x=drift["order"], line={"color": DRIFT_COLOUR, "width": 2, "dash": "dash"})
        fig.add_annotation(x=drift["order"], y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"first drift: {_esc(drift['tensor'])} (order {drift['order']})",
                           font={"color": "#8a6500"}, bgcolor="rgba(255,255,255,0.85)")
    fig.update_yaxes(type="log", title="relative L2 vs FP32 reference", exponentformat="power", dtick=1,
                     range=[math.log10(lo) - 0.15, math.log10(hi) + 0.25])
    fig.update_xaxes(title="execution order (forward hooks, then backward)")
    return _layout(fig, 560, legend={"orientation": "h", "y": -0.16}, hovermode="closest")


def heatmap_figure(verdict: Mapping[str, Any]) -> go.Figure:
    """Worst ratio to the bound per (block, tensor kind); rows in execution order of their first tensor."""
    cells: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    first: dict[str, int] = {}
    for t in verdict.get("tensors", ()):
        b = block_of(t["name"])
        cells.setdefault((b, t["kind"]), []).append(t)
        first[b] = min(first.get(b, t["order"]), t["order"])
    top = {}  # a module's rows stay together ("token_refiner" next to its refiner blocks)
    for b, o in first.items():
        top[b.split(".")[0]] = min(top.get(b.split(".")[0], o), o)
    rows = sorted(first, key=lambda b: (top[b.split(".")[0]], first[b], b))
    kinds = [k for k in KIND_ORDER if any(c[1] == k for c in cells)]
    kinds += sorted({c[1] for c in cells} - set(kinds))
    z, text, data = [], [], []
    for b in rows:
        zr, tr, dr = [], [], []
        for k in kinds:
            ts = cells.get((b, k))
            if not ts:
                zr.append(None)
                tr.append("")
                dr.append(["", 0, ""])
                continue
            w = max(ts, key=_ratio_key)
            r = _ratio_key(w)
            zr.append(max(_HEAT_LO, min(_HEAT_HI, math.log10(r))) if r > 0 else _HEAT_LO)
            tr.append(_fmt(r, ".2f"))
            dr.append([w["name"], len(ts), "pass" if all(t["passed"] for t in ts) else "FAIL"])
        z.append(zr)
        text.append(tr)
        data.append(dr)
    ticks = [0.01, 0.1, 0.5, 1, 2, 10]
    fig = go.Figure(go.Heatmap(
        z=z, x=kinds, y=rows, text=text, texttemplate="%{text}", customdata=data, xgap=2, ygap=2,
        zmin=_HEAT_LO, zmax=_HEAT_HI, colorscale=_HEAT_SCALE, hoverongaps=False,
        colorbar={"title": {"text": "error / bound"}, "tickvals": [math.log10(v) for v in ticks],
                  "ticktext": [f"{v:g}" for v in ticks]},
        hovertemplate="%{y} · %{x}<br>worst: %{customdata[0]}<br>ratio %{text} (%{customdata[2]}, "
                      "%{customdata[1]} tensors)<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category", showgrid=False)
    fig.update_xaxes(side="top", type="category", showgrid=False)
    return _layout(fig, max(320, 26 * len(rows) + 110), margin={"l": 260, "r": 30, "t": 60, "b": 20})


def calibration_figure(rule: Mapping[str, Any]) -> go.Figure:
    """Leave-one-out ratio per held-out provider against the calibrated k."""
    loo = rule.get("leave_one_out", {})
    names = sorted(loo)
    k = _num(rule.get("k"))
    fig = go.Figure(go.Bar(
        x=names, y=[_num(loo[p]["ratio"]) for p in names], marker_color="#3d5a80", name="held-out ratio",
        text=[_fmt(loo[p]["ratio"], ".4g") for p in names], textposition="outside",
        customdata=[[loo[p].get("tensor") or "(all at or below the floor)"] for p in names],
        hovertemplate="held out %{x}<br>ratio %{y:.4g}<br>binding tensor %{customdata[0]}<extra></extra>"))
    fig.add_hline(y=k, line={"color": FAIL_COLOUR, "dash": "dash"}, annotation_text=f"k = {_fmt(k, '.4g')}",
                  annotation_position="top right")
    fig.update_yaxes(title="smallest k that passes the held-out provider", rangemode="tozero")
    fig.update_xaxes(title="held-out provider")
    return _layout(fig, 380, showlegend=False)


# -- HTML -----------------------------------------------------------------------------------------

_CSS = """
body{margin:0;background:#f6f8fa;color:#1f2328;font:14px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif}
main{max-width:1360px;margin:0 auto;padding:24px}
section{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:16px 20px;margin:0 0 20px}
h1{margin:0;font-size:22px}h2{margin:0 0 8px;font-size:18px;border-bottom:1px solid #eaeef2;padding-bottom:6px}
.head{display:flex;align-items:center;gap:20px}.sub{color:#59636e;margin:2px 0 0}
.badge{font-size:40px;font-weight:800;letter-spacing:2px;color:#fff;padding:6px 26px;border-radius:8px}
.pass{background:#1a7f37}.fail{background:#cf222e}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{border:1px solid #d0d7de;border-radius:6px;padding:8px 14px;min-width:104px}
.card b{display:block;font-size:22px}.card span{color:#59636e;font-size:12px}.card.bad b{color:#cf222e}
table{border-collapse:collapse;width:100%;font-size:13px}td,th{border-bottom:1px solid #eaeef2;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px;word-break:break-all}
dl{display:grid;grid-template-columns:220px 1fr;gap:4px 12px;margin:8px 0}dt{color:#59636e}dd{margin:0}
tr.f td{background:#fff0f0}.ok{color:#1a7f37;font-weight:600}.no{color:#cf222e;font-weight:600}
.note{color:#59636e;font-size:13px;margin:4px 0 8px}footer{color:#59636e;font-size:12px;text-align:center}
"""


def _names_html(names: Iterable[str], limit: int = 12) -> str:
    names = list(names)
    if not names:
        return '<span class="ok">none</span>'
    shown = ", ".join(f"<code>{_esc(n)}</code>" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _value_html(v: Any) -> str:
    if isinstance(v, Mapping):
        return "<br>".join(f"{_esc(k)}: {_value_html(x)}" for k, x in v.items()) or "—"
    if isinstance(v, (list, tuple)):
        return ", ".join(_value_html(x) for x in v) or "—"
    return f'<span class="mono">{_esc(v)}</span>'


def _header(v: Mapping[str, Any], rule: Mapping[str, Any], identity: Mapping[str, Any]) -> str:
    ok = bool(v.get("passed"))
    drifted = sum(1 for t in v.get("tensors", ()) if t["drift"])
    over = [t for t in v.get("failures", ()) if t not in set(v.get("missing", ()))]
    cards = [("gated", v.get("gated"), False), ("compared", v.get("compared"), False),
             ("failing", len(over), bool(over)), ("missing", len(v.get("missing", ())), bool(v.get("missing"))),
             ("non-finite", len(v.get("nonfinite", ())), bool(v.get("nonfinite"))),
             ("above every provider", drifted, False), ("nodes never ran", len(v.get("ledger_missing", ())),
                                                         bool(v.get("ledger_missing"))),
             ("ungated", len(v.get("ungated", ())), False)]
    w, d, sp = v.get("worst"), v.get("first_drift"), v.get("single_provider") or {}
    worst = (f"<code>{_esc(w['tensor'])}</code> at <b>{_fmt(w['ratio'])}</b> × its bound (relative L2 "
             f"{_fmt(w['relative_l2'])}, bound {_fmt(w['bound'])})") if w else "nothing compared"
    drift = (f"<code>{_esc(d['tensor'])}</code> (order {d['order']}): error {_fmt(d['relative_l2'])} above the "
             f"largest provider error {_fmt(d['max_provider_error'])}") if d else '<span class="ok">no drift</span>'
    single = ("not recorded" if sp.get("passed") is None else '<span class="ok">pass</span>' if sp["passed"]
              else f'<span class="no">fail</span>: {_names_html(sp.get("failures", ()), 6)}')
    rule_txt = (f"relative L2 ≤ k × max provider error + floor, k = {_fmt(rule.get('k', v.get('k')), '.4g')}, floor = "
                f"{_fmt(rule.get('floor', v.get('floor')))}, providers: {_esc(', '.join(v.get('providers', ())))}")
    ident = "".join(f"<tr><th>{_esc(k)}</th><td>{_value_html(x)}</td></tr>" for k, x in identity.items()
                    if k != "title")
    return (
        f'<section id="verdict"><div class="head"><div class="badge {"pass" if ok else "fail"}">'
        f'{"PASS" if ok else "FAIL"}</div><div><h1>{_esc(identity.get("title", "h3gate drift report"))}</h1>'
        f'<p class="sub">{rule_txt}</p></div></div><div class="cards">'
        + "".join(f'<div class="card{" bad" if bad else ""}"><b>{_esc(n)}</b><span>{_esc(label)}</span></div>'
                  for label, n, bad in cards)
        + f"</div><dl><dt>Worst tensor</dt><dd>{worst}</dd><dt>First drift</dt><dd>{drift}</dd>"
        f"<dt>Failing tensors</dt><dd>{_names_html(over)}</dd><dt>Missing from the candidate</dt>"
        f"<dd>{_names_html(v.get('missing', ()))}</dd><dt>Non-finite</dt><dd>{_names_html(v.get('nonfinite', ()))}</dd>"
        f"<dt>Candidate nodes that never ran</dt><dd>{_names_html(v.get('ledger_missing', ()))}</dd>"
        f"<dt>Single-provider record</dt><dd>{single} <span class='note'>(1.5 × default provider error + floor; "
        f"not gating)</span></dd><dt>Reference manifest</dt><dd><code>{_esc(v.get('reference_manifest_sha'))}"
        f"</code></dd></dl><h2>Identity</h2><table>{ident}</table></section>"
    )


def _worst_table(verdict: Mapping[str, Any]) -> str:
    cols = ("rank", "tensor", "kind", "order", "ratio", "relative_l2", "bound", "max_provider_error", "max_abs")
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in cols) + "<th>result</th>"
    body = ""
    for r in worst_rows(verdict):
        cells = "".join(f"<td class='n'>{_esc(r[c] if c in ('rank', 'order') else _fmt(r[c]))}</td>"
                        if c not in ("tensor", "kind") else f"<td><code>{_esc(r[c])}</code></td>" for c in cols)
        res = '<span class="no">FAIL</span>' if not r["passed"] else ("drift" if r["drift"] else "pass")
        body += f"<tr{' class=f' if not r['passed'] else ''}>{cells}<td>{res}</td></tr>"
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure_html(fig: Any, div_id: str, redact: Redact | None = None) -> str:
    if redact is not None:  # an outside figure: redact its text (titles, hover data), never plotly.js itself
        fig = go.Figure(_redact_tree(fig.to_plotly_json(), redact))
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=PLOT_CONFIG,
                       default_width="100%", default_height=f"{fig.layout.height or 450}px")


def build_report(verdict: Mapping[str, Any], provider_errors: Mapping[str, Mapping[str, Any]],
                 rule: Mapping[str, Any], identity: Mapping[str, Any], extra_sections: Iterable[Section] = (),
                 *, redact: Redact | None = None) -> str:
    """One self-contained HTML drift report (module docstring); plotly.js is embedded once, in <head>."""
    r = default_redactor() if redact is None else redact
    v, pe, ru = (_redact_tree(x, r) for x in (verdict, provider_errors, rule))
    ident = _redact_tree(identity, r, mask_secrets=True)
    sections = [
        _header(v, ru, ident),
        "<section id='errors'><h2>2 · Error per tensor, in execution order</h2><p class='note'>Candidate, every "
        "BF16 provider and the ensemble bound (k × max provider error + floor) against the FP32 reference. Amber: "
        "above every provider (drift); red ×: over the bound. Zero errors sit on the bottom edge, non-finite on the "
        "top edge.</p>" + _figure_html(error_figure(v, pe), "h3-errors") + "</section>",
        "<section id='heatmap'><h2>3 · Worst ratio to the bound, by block and tensor kind</h2><p class='note'>Cell "
        "= the largest candidate error / bound of the tensors in that block and kind; above 1 fails.</p>"
        + _figure_html(heatmap_figure(v), "h3-heatmap") + "</section>",
        f"<section id='calibration'><h2>4 · Calibration</h2><dl><dt>k (calibrated)</dt><dd>{_fmt(ru.get('k'), '.6g')}"
        f" (raw {_fmt(ru.get('k_raw'), '.6g')}, clamped to ≥ 1)</dd><dt>floor</dt><dd>{_fmt(ru.get('floor'), '.4g')}"
        f"</dd><dt>floor method</dt><dd>{_esc(ru.get('floor_method', 'n/a'))}</dd><dt>providers</dt><dd>"
        f"{_esc(', '.join(ru.get('providers', ())))}</dd></dl><p class='note'>Each provider held out in turn: the "
        "smallest k at which it passes against the others. k is the largest of them.</p>"
        + _figure_html(calibration_figure(ru), "h3-calibration") + "</section>",
        f"<section id='worst'><h2>5 · The {WORST_N} worst tensors</h2>{_worst_table(v)}</section>",
    ]
    for i, (title, content) in enumerate(extra_sections, 6):
        body = (_figure_html(content, f"h3-extra-{i}", r) if hasattr(content, "to_plotly_json")
                else r(str(content)))
        sections.append(f"<section id='extra-{i}'><h2>{i} · {_esc(r(str(title)))}</h2>{body}</section>")
    title = _esc(f"{'PASS' if v.get('passed') else 'FAIL'} · {ident.get('title', 'h3gate drift report')}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style>'
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head><body><main>'
        + "\n".join(sections)
        + f"<footer>h3gate drift report · {_esc(v.get('schema', ''))} · self-contained, works offline</footer>"
        "</main></body></html>\n"
    )


# -- markdown, store, Prefect ---------------------------------------------------------------------


def verdict_markdown(verdict: Mapping[str, Any], identity: Mapping[str, Any], report_url: str,
                     *, redact: Redact | None = None) -> str:
    """The markdown verdict artifact: PASS/FAIL, worst, first drift, counts, link to the report."""
    r = default_redactor() if redact is None else redact
    v, ident = _redact_tree(verdict, r), _redact_tree(identity, r, mask_secrets=True)
    w, d = v.get("worst"), v.get("first_drift")
    missing = set(v.get("missing", ()))
    over = [t for t in v.get("failures", ()) if t not in missing]
    what = " · ".join(str(ident[k]) for k in ("title", "preset") if ident.get(k))
    lines = [f"## h3gate verdict: **{'PASS' if v.get('passed') else 'FAIL'}**" + (f" — {what}" if what else ""), "",
             "| gated | compared | failing | missing | non-finite | nodes never ran |", "|---|---|---|---|---|---|",
             f"| {v.get('gated')} | {v.get('compared')} | {len(over)} | {len(missing)} | "
             f"{len(v.get('nonfinite', ()))} | {len(v.get('ledger_missing', ()))} |", ""]
    lines.append(f"- **Worst:** `{w['tensor']}` at {_fmt(w['ratio'])} × its bound (relative L2 "
                 f"{_fmt(w['relative_l2'])}, bound {_fmt(w['bound'])})" if w else "- **Worst:** nothing compared")
    lines.append(f"- **First drift:** `{d['tensor']}` (order {d['order']}): {_fmt(d['relative_l2'])} above the "
                 f"largest provider error {_fmt(d['max_provider_error'])}" if d else "- **First drift:** none")
    if over:
        lines.append("- **Failing:** " + ", ".join(f"`{t}`" for t in over[:10]) + (" …" if len(over) > 10 else ""))
    if v.get("ledger_missing"):
        lines.append("- **Candidate nodes that never ran:** " + ", ".join(f"`{n}`" for n in v["ledger_missing"]))
    sp = (v.get("single_provider") or {}).get("passed")
    if sp is not None:
        lines.append(f"- **Single-provider record (not gating):** {'pass' if sp else 'fail'}")
    lines += [f"- **Rule:** k = {_fmt(v.get('k'), '.4g')}, floor = {_fmt(v.get('floor'))}, providers: "
              f"{', '.join(v.get('providers', ()))}", "", f"[Drift report]({report_url})"]
    return "\n".join(lines) + "\n"


def store_report(store: Any, html_text: str, *, run_id: str) -> tuple[str, str]:
    """Write the report as a blob and as runs/<run_id>/report.html; return (printable URL, sha256)."""
    data = html_text.encode("utf-8")
    ref = store.put_bytes(data)
    key = f"runs/{validate_name(run_id, single=True, what='run id')}/report.html"
    fs, path = store.fs, f"{store.root}/{key}"
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.part"  # same directory, same filesystem: os.replace is atomic
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:  # object stores: one PUT is atomic per object (see store.py)
        fs.pipe_file(path, data)
    return f"{store.url}/{key}", ref.sha256


def publish_artifacts(verdict: Mapping[str, Any], identity: Mapping[str, Any], report_url: str, *,
                      key_prefix: str, redact: Redact | None = None) -> dict[str, Any]:
    """Markdown verdict, worst-tensor table and report link as Prefect artifacts; returns their ids by role."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    if not _KEY_RE.fullmatch(key_prefix):
        raise ValueError(f"artifact key prefix {key_prefix!r} must be kebab-case (lowercase letters, digits, '-')")
    state = "PASS" if verdict.get("passed") else "FAIL"
    # _sync=True: the same blocking call from a sync or an async task (these functions dispatch on context).
    return {
        "verdict": create_markdown_artifact(markdown=verdict_markdown(verdict, identity, report_url, redact=redact),
                                            key=f"{key_prefix}-verdict", description=f"h3gate verdict: {state}",
                                            _sync=True),
        "worst": create_table_artifact(table=worst_rows(verdict), key=f"{key_prefix}-worst-tensors",
                                       description=f"the {WORST_N} tensors closest to (or over) their bound",
                                       _sync=True),
        "report": create_link_artifact(link=report_url, link_text=f"h3gate drift report ({state})",
                                       key=f"{key_prefix}-report", description="self-contained HTML drift report",
                                       _sync=True),
    }
