"""The drift report of one gate run: a self-contained HTML page, a markdown verdict, Prefect artifacts.

Inputs are plain JSON-able dicts, so a report can be rebuilt from the store alone: ``verdict``
(``rules.Verdict.to_dict()``), ``provider_errors`` ({provider: {tensor: relative_l2}}), ``rule``
(``EnsembleRule.to_dict()``), ``identity`` (any {key: value}, rendered in order; nested dicts and lists
are fine). Floats may be the strings "inf"/"-inf"/"nan" (``compare.parse_float``).

``build_report`` returns one HTML document with plotly.js embedded once, inline in ``<head>``; each figure
is a div drawn by an inline ``Plotly.newPlot``. No CDN, no ``src``/``href`` to the network, no fonts or
images fetched: it renders offline. Equal inputs give equal bytes (fixed div ids, no clock). Sections:
1 verdict (PASS/FAIL, counts, worst tensor and its ratio to its bound, first drift, single-provider
record, ledger nodes that never ran, identity table); 2 error per tensor in execution order (candidate,
each provider, the ensemble bound; log y; first drift and failures marked); 3 worst ratio per (block,
kind); 4 leave-one-out calibration against k; 5 the 20 worst tensors; then each ``extra_sections`` item
(title, content): an HTML fragment (``str``, trusted markup) or a plotly figure (has ``to_plotly_json``).

Redaction: every string from the inputs (keys, extra fragments and figure text too) passes ``redact``,
by default ``default_redactor()``: home directory -> ``~``, host name -> ``<host>``, URL userinfo ->
``***@``. Identity values under secret-looking keys (secret, password, credential, token, api/access/
private key) become ``***``. ``redact=lambda s: s`` turns the text hook off. plotly.js is never rewritten.

``store_report`` writes the HTML as a blob and as ``runs/<run_id>/report.html`` (local: temp file, fsync,
``os.replace``; object stores: one PUT, atomic per object) and returns (URL under ``store.url``, which
has no credentials; sha256). ``publish_artifacts`` (Prefect imported lazily; call it in a flow or task)
creates ``<key_prefix>-verdict`` (markdown), ``<key_prefix>-worst-tensors`` (table) and
``<key_prefix>-report`` (link). The report URL is published as given, unredacted: it must stay a link.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import plotly.graph_objects as go
from fsspec.implementations.local import LocalFileSystem
from plotly.offline import get_plotlyjs

from tasks.compare import json_float
from tasks.report_figures import (
    KIND_ORDER,
    PLOT_CONFIG,
    block_of,
    calibration_figure,
    error_figure,
    esc,
    fmt,
    heatmap_figure,
    num,
    ratio_key,
)
from tasks.rules import SINGLE_PROVIDER_FACTOR
from tasks.store import validate_name

__all__ = ["KIND_ORDER", "WORST_N", "block_of", "build_report", "calibration_figure", "default_redactor",
           "error_figure", "heatmap_figure", "publish_artifacts", "store_report", "verdict_markdown", "worst_rows"]

Redact = Callable[[str], str]
Section = tuple[str, Any]  # (title, HTML fragment str | plotly figure)

WORST_N = 20

_SECRET_KEY_RE = re.compile(r"secret|passw|credential|(api|access|private|auth)[_ -]?key|(^|[_ -])token($|[_ -])", re.I)
_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]*@")
_KEY_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


# -- redaction ------------------------------------------------------------------------------------


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


# -- tables ---------------------------------------------------------------------------------------


def worst_rows(verdict: Mapping[str, Any], n: int = WORST_N) -> list[dict[str, Any]]:
    """The ``n`` compared tensors with the largest ratio to their bound (ties: execution order), JSON-able."""
    ranked = sorted(verdict.get("tensors", ()), key=lambda t: (-ratio_key(t), t["order"], t["name"]))[:n]

    def sig(x: Any) -> float | str | None:
        return None if x is None else json_float(float(f"{num(x):.4g}"))

    return [
        {"rank": i, "tensor": t["name"], "kind": t["kind"], "order": t["order"], "ratio": sig(t["ratio"]),
         "relative_l2": sig(t["relative_l2"]), "bound": sig(t["bound"]),
         "max_provider_error": sig(t["max_provider_error"]), "max_abs": sig(t.get("max_abs")),
         "passed": bool(t["passed"]), "drift": bool(t["drift"])}
        for i, t in enumerate(ranked, 1)
    ]


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
text-align:left;vertical-align:top}th{background:#f6f8fa}.n{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px;word-break:break-all}
dl{display:grid;grid-template-columns:220px 1fr;gap:4px 12px;margin:8px 0}dt{color:#59636e}dd{margin:0}
tr.f td{background:#fff0f0}.ok{color:#1a7f37;font-weight:600}.no{color:#cf222e;font-weight:600}
summary{cursor:pointer;color:#0969da}.note{color:#59636e;font-size:13px;margin:4px 0 8px}
footer{color:#59636e;font-size:12px;text-align:center}
"""


def _names_html(names: Iterable[str], limit: int = 12) -> str:
    names = [f"<code>{esc(n)}</code>" for n in names]
    if not names:
        return '<span class="ok">none</span>'
    rest = f"<details><summary>and {len(names) - limit} more</summary>{', '.join(names[limit:])}</details>"
    return ", ".join(names[:limit]) + (rest if len(names) > limit else "")


def _value_html(v: Any) -> str:
    if isinstance(v, Mapping):
        return "<br>".join(f"{esc(k)}: {_value_html(x)}" for k, x in v.items()) or "—"
    if isinstance(v, (list, tuple)):
        return ", ".join(_value_html(x) for x in v) or "—"
    return f'<span class="mono">{esc(v)}</span>'


def _header(v: Mapping[str, Any], rule: Mapping[str, Any], identity: Mapping[str, Any]) -> str:
    ok, missing, nonfinite, ledger = bool(v.get("passed")), v.get("missing", []), v.get("nonfinite", []), v.get(
        "ledger_missing", [])
    over = [t for t in v.get("failures", ()) if t not in set(missing)]
    cards = [("gated", v.get("gated"), False), ("compared", v.get("compared"), False), ("failing", len(over), over),
             ("missing", len(missing), missing), ("non-finite", len(nonfinite), nonfinite),
             ("above every provider", sum(1 for t in v.get("tensors", ()) if t["drift"]), False),
             ("nodes never ran", len(ledger), ledger), ("ungated", len(v.get("ungated", ())), False)]
    w, d, sp = v.get("worst"), v.get("first_drift"), v.get("single_provider") or {}
    single = ("not recorded" if sp.get("passed") is None else '<span class="ok">pass</span>' if sp["passed"]
              else f'<span class="no">fail</span>: {_names_html(sp.get("failures", ()), 6)}')
    facts = [
        ("Worst tensor", f"<code>{esc(w['tensor'])}</code> at <b>{fmt(w['ratio'])}</b> × its bound (relative L2 "
                         f"{fmt(w['relative_l2'])}, bound {fmt(w['bound'])})" if w else "nothing compared"),
        ("First drift", f"<code>{esc(d['tensor'])}</code> (order {d['order']}): error {fmt(d['relative_l2'])} "
                        f"above the largest provider error {fmt(d['max_provider_error'])}"
         if d else '<span class="ok">no drift</span>'),
        ("Failing tensors", _names_html(over)), ("Missing from the candidate", _names_html(missing)),
        ("Non-finite", _names_html(nonfinite)), ("Candidate nodes that never ran", _names_html(ledger)),
        ("Single-provider record", f"{single} <span class='note'>({SINGLE_PROVIDER_FACTOR:g} × default provider "
                                   "error + floor; not gating)</span>"),
        ("Reference manifest", f"<code>{esc(v.get('reference_manifest_sha'))}</code>")]
    rule_txt = (f"relative L2 ≤ k × max provider error + floor, k = {fmt(rule.get('k', v.get('k')), '.4g')}, floor = "
                f"{fmt(rule.get('floor', v.get('floor')))}, providers: {esc(', '.join(v.get('providers', ())))}")
    return (
        f'<section id="verdict"><div class="head"><div class="badge {"pass" if ok else "fail"}">'
        f'{"PASS" if ok else "FAIL"}</div><div><h1>{esc(identity.get("title", "h3gate drift report"))}</h1>'
        f'<p class="sub">{rule_txt}</p></div></div><div class="cards">'
        + "".join(f'<div class="card{" bad" if bad else ""}"><b>{esc(n)}</b><span>{label}</span></div>'
                  for label, n, bad in cards)
        + "</div><dl>" + "".join(f"<dt>{a}</dt><dd>{b}</dd>" for a, b in facts) + "</dl><h2>Identity</h2><table>"
        + "".join(f"<tr><th>{esc(k)}</th><td>{_value_html(x)}</td></tr>" for k, x in identity.items() if k != "title")
        + "</table></section>"
    )


def _worst_table(verdict: Mapping[str, Any]) -> str:
    cols = ("rank", "tensor", "kind", "order", "ratio", "relative_l2", "bound", "max_provider_error", "max_abs")
    head = "".join(f"<th{'' if c in ('tensor', 'kind') else ' class=n'}>{c.replace('_', ' ')}</th>" for c in cols)
    head += "<th>result</th>"
    body = ""
    for r in worst_rows(verdict):
        cells = "".join(f"<td class='n'>{esc(r[c] if c in ('rank', 'order') else fmt(r[c]))}</td>"
                        if c not in ("tensor", "kind") else f"<td><code>{esc(r[c])}</code></td>" for c in cols)
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
        "<section id='calibration'><h2>4 · Calibration</h2><dl>" + "".join(f"<dt>{a}</dt><dd>{b}</dd>" for a, b in (
            ("k", f"{fmt(ru.get('k'), '.6g')} = max(1, raw {fmt(ru.get('k_raw'), '.6g')})"),
            ("floor", f"{fmt(ru.get('floor'), '.4g')}"), ("floor method", esc(ru.get("floor_method", "n/a"))),
            ("binding tensors", "<br>".join(f"{esc(p)}: <code>{esc(x.get('tensor') or '(none above the floor)')}"
                                            f"</code>" for p, x in sorted(ru.get("leave_one_out", {}).items()))),
            ("reference manifest", f"<code>{esc(ru.get('reference_manifest_sha'))}</code>")))
        + "</dl><p class='note'>Each provider held out in turn: the smallest k at which it passes against the "
        "others (provider data only, no candidate data). k is the largest of them.</p>"
        + _figure_html(calibration_figure(ru), "h3-calibration") + "</section>",
        f"<section id='worst'><h2>5 · The {WORST_N} worst tensors</h2>{_worst_table(v)}</section>",
    ]
    for i, (title, content) in enumerate(extra_sections, 6):
        body = (_figure_html(content, f"h3-extra-{i}", r) if hasattr(content, "to_plotly_json")
                else r(str(content)))
        sections.append(f"<section id='extra-{i}'><h2>{i} · {esc(r(str(title)))}</h2>{body}</section>")
    title = esc(f"{'PASS' if v.get('passed') else 'FAIL'} · {ident.get('title', 'h3gate drift report')}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style>'
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head><body><main>'
        + "\n".join(sections)
        + f"<footer>h3gate drift report · {esc(v.get('schema', ''))} · self-contained, works offline</footer>"
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
    lines.append(f"- **Worst:** `{w['tensor']}` at {fmt(w['ratio'])} × its bound (relative L2 "
                 f"{fmt(w['relative_l2'])}, bound {fmt(w['bound'])})" if w else "- **Worst:** nothing compared")
    lines.append(f"- **First drift:** `{d['tensor']}` (order {d['order']}): {fmt(d['relative_l2'])} above the "
                 f"largest provider error {fmt(d['max_provider_error'])}" if d else "- **First drift:** none")
    if over:
        lines.append("- **Failing:** " + ", ".join(f"`{t}`" for t in over[:10]) + (" …" if len(over) > 10 else ""))
    if v.get("ledger_missing"):
        lines.append("- **Candidate nodes that never ran:** " + ", ".join(f"`{n}`" for n in v["ledger_missing"]))
    sp = (v.get("single_provider") or {}).get("passed")
    if sp is not None:
        lines.append(f"- **Single-provider record (not gating):** {'pass' if sp else 'fail'}")
    lines += [f"- **Rule:** k = {fmt(v.get('k'), '.4g')}, floor = {fmt(v.get('floor'))}, providers: "
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
