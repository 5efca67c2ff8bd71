"""Plotly figures of the drift report (tasks/report.py assembles them): per-tensor error, ratio heatmap, calibration.

Inputs are the report's JSON-able dicts (``rules.Verdict.to_dict()``, {provider: {tensor: relative_l2}},
``EnsembleRule.to_dict()``); floats may be "inf"/"nan" strings. Heatmap rows (``block_of``): a block
("transformer_blocks.12", "token_refiner.refiner_blocks.0"), else the top-level module ("proj_in",
"time_embedder"); model outputs are "output", input gradients "input". Columns: tensor kinds in
``KIND_ORDER``. A cell is the worst ratio (candidate error / bound) of its tensors.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from tasks.compare import parse_float

KIND_ORDER = ("out", "dinput", "grad", "fwd", "bwd", "in")
FORWARD_KINDS = {"fwd", "in", "out"}
PASS_COLOUR, FAIL_COLOUR, DRIFT_COLOUR, CAND_COLOUR = "#1a7f37", "#cf222e", "#d4a017", "#0b3d91"
PROVIDER_COLOURS = ("#7f8c8d", "#8e6cc1", "#2a9d8f", "#e07a5f", "#3d5a80", "#b5838d")
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
_BLOCK_RE = re.compile(r"^((?:\w+\.)*?\w*blocks\.\d+)(?=\.|$)")
# Heatmap colours live on log10(ratio) in [-2, 1], so ratio 1 (the bound) sits at 2/3: blues up to 0.7 (a
# candidate as good as the providers sits near 1/k), amber from 0.9, and a hard break at 1 so every failing
# cell is red-orange.
_HEAT_LO, _HEAT_HI = -2.0, 1.0
_HEAT_SCALE = [[0.0, "#f7fbff"], [0.45, "#c6dbef"], [0.615, "#4a84c4"], [0.655, "#f2c14e"], [0.6666, "#f2a03d"],
               [0.6667, "#e8590c"], [1.0, "#99000d"]]  # 0.615: ratio 0.7, 0.655: ratio 0.9


def num(x: Any) -> float:
    """A verdict number as float (None -> nan; "inf"/"nan" strings parsed)."""
    return math.nan if x is None else parse_float(x)


def fmt(x: Any, spec: str = ".3g") -> str:
    v = num(x)
    return "n/a" if math.isnan(v) else ("inf" if math.isinf(v) else format(v, spec))


def ratio_key(t: Mapping[str, Any]) -> float:
    r = num(t.get("ratio"))
    return math.inf if math.isnan(r) else r  # an unknown ratio never hides below a known one


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


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


def _layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    kw = {"margin": {"l": 70, "r": 30, "t": 40, "b": 60}, **kw}
    fig.update_layout(height=height, template="plotly_white", hoverlabel={"font": {"family": "ui-monospace"}},
                      font={"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12}, **kw)
    return fig


def error_figure(verdict: Mapping[str, Any], provider_errors: Mapping[str, Mapping[str, float]]) -> go.Figure:
    """Candidate, provider and bound error per tensor against execution order (log y)."""
    ts = sorted(verdict.get("tensors", ()), key=lambda t: t["order"])
    finite = [v for t in ts for v in (num(t["relative_l2"]), num(t["bound"])) if math.isfinite(v) and v > 0]
    finite += [v for e in provider_errors.values() for v in map(num, e.values()) if math.isfinite(v) and v > 0]
    lo, hi = (min(finite) / 3, max(finite) * 5) if finite else (1e-8, 1.0)

    def y(v: Any) -> float:  # zero sits on the bottom edge and non-finite on the top edge of the axis
        v = num(v)
        return hi if not math.isfinite(v) else (lo if v <= 0 else v)

    fig = go.Figure()
    hover = "%{customdata[0]}<br>order %{x}<br>%{customdata[1]}<extra>%{fullData.name}</extra>"
    for i, (p, errs) in enumerate(sorted(provider_errors.items())):
        pts = [(t["order"], errs[t["name"]], t["name"]) for t in ts if t["name"] in errs]
        fig.add_scatter(x=[o for o, _, _ in pts], y=[y(e) for _, e, _ in pts], mode="markers", name=f"provider {p}",
                        marker={"size": 5, "opacity": 0.55, "color": PROVIDER_COLOURS[i % len(PROVIDER_COLOURS)]},
                        customdata=[[n, f"relative L2 {fmt(e)}"] for _, e, n in pts], hovertemplate=hover)
    fig.add_scatter(x=[t["order"] for t in ts], y=[y(t["bound"]) for t in ts], mode="lines+markers",
                    name="ensemble bound", line={"color": "rgba(34,34,34,0.3)", "width": 1},
                    marker={"symbol": "line-ew", "size": 11, "line": {"width": 2, "color": "#222"}},
                    customdata=[[t["name"], f"bound {fmt(t['bound'])}"] for t in ts], hovertemplate=hover)
    groups = (("candidate", CAND_COLOUR, "circle", 6, lambda t: t["passed"] and not t["drift"]),
              ("candidate, above every provider", DRIFT_COLOUR, "diamond", 8, lambda t: t["passed"] and t["drift"]),
              ("candidate, FAIL", FAIL_COLOUR, "x", 11, lambda t: not t["passed"] and math.isfinite(num(t["ratio"]))),
              ("candidate, non-finite (top edge)", FAIL_COLOUR, "triangle-up", 12,
               lambda t: not t["passed"] and not math.isfinite(num(t["ratio"]))))
    for name, colour, symbol, size, keep in groups:
        if not (sel := [t for t in ts if keep(t)]):
            continue  # no empty legend entries ("candidate, FAIL" on a pass)
        fig.add_scatter(x=[t["order"] for t in sel], y=[y(t["relative_l2"]) for t in sel], mode="markers",
                        name=name, marker={"color": colour, "symbol": symbol, "size": size,
                                           "line": {"width": 1, "color": colour if symbol == "x" else "white"}},
                        customdata=[[t["name"], f"relative L2 {fmt(t['relative_l2'])} · bound {fmt(t['bound'])}"
                                     f" · ratio {fmt(t['ratio'])}"] for t in sel], hovertemplate=hover)
    back = [t["order"] for t in ts if t["kind"] not in FORWARD_KINDS]
    if back and ts:
        fig.add_vrect(x0=min(back) - 0.5, x1=ts[-1]["order"] + 0.5, fillcolor="#6b7b8c", opacity=0.06, line_width=0,
                      annotation_text="backward", annotation_position="top left")
    drift = verdict.get("first_drift")
    if drift:
        fig.add_vline(x=drift["order"], line={"color": DRIFT_COLOUR, "width": 2, "dash": "dash"})
        fig.add_annotation(x=drift["order"], y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"first drift: {esc(drift['tensor'])} (order {drift['order']})",
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
            w = max(ts, key=ratio_key)
            r = ratio_key(w)
            zr.append(max(_HEAT_LO, min(_HEAT_HI, math.log10(r))) if r > 0 else _HEAT_LO)
            tr.append(fmt(r, ".2f"))
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
    k = num(rule.get("k"))
    fig = go.Figure(go.Bar(
        x=names, y=[num(loo[p]["ratio"]) for p in names], marker_color="#3d5a80", name="held-out ratio",
        text=[fmt(loo[p]["ratio"], ".4g") for p in names], textposition="outside",
        customdata=[[loo[p].get("tensor") or "(all at or below the floor)"] for p in names],
        hovertemplate="held out %{x}<br>ratio %{y:.4g}<br>binding tensor %{customdata[0]}<extra></extra>"))
    fig.add_hline(y=k, line={"color": FAIL_COLOUR, "dash": "dash"}, annotation_text=f"k = {fmt(k, '.4g')}",
                  annotation_position="top right")
    fig.update_yaxes(title="smallest k that passes the held-out provider", rangemode="tozero")
    fig.update_xaxes(title="held-out provider")
    return _layout(fig, 380, showlegend=False)
