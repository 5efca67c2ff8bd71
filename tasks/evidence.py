"""Evidence bundle of one gate: what ran and why, what was redacted, every file hashed (DESIGN 8).

``build_bundle(store, gate_id, out)`` writes into ``out``:

    SUMMARY.md        a markdown section to paste into a pull request: verdict, fixed links by hash
    tests.json        every gate check, every golden test, every ledger node: name, outcome, skip_reason
    redaction.json    what was removed from logs and metadata (hosts, users, paths, tokens/keys), with counts
    verdict.json      runs/<gate_id>/verdict.json (redacted)
    ledger.json       runs/<gate_id>/ledger.json (redacted)
    report.html       runs/<gate_id>/report.html, byte for byte (tasks.report redacts when it builds it)
    manifests/<run>.json   each run's manifest hash, identity and redacted metadata (tensor records stay in the store)
    logs/<name>.log   log lines handed in (e.g. the Prefect flow-run logs), redacted
    SHA256SUMS        sha256sum -c format over every other file: ``cd out && sha256sum -c SHA256SUMS``

Links are content addresses: ``<store>/blobs/sha256/<aa>/<sha256>``. A local store's path is not published
(``<store>`` stands for it); object-store URLs are. No Prefect import here: flows/evidence.py adds the flow-run
links and logs when a server is in use.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import socket
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tasks.reference import load_reference
from tasks.store import Store, validate_name

SCHEMA = "h3gate.evidence/1"

# Secrets by shape: AWS access key ids, AWS-style 40-character secrets (mixed case, so a git sha never matches),
# GitHub/Slack-style tokens, bearer tokens, and values of secret-looking key=value pairs.
_AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA)[A-Z0-9]{16}(?![A-Z0-9])")
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]*[A-Z])(?=[A-Za-z0-9/+=]*[a-z])"
                         r"[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])")
_TOKEN = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|xox[abprs]-[A-Za-z0-9-]{10,}|hf_[A-Za-z0-9]{30,})\b")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_KEY_VALUE = re.compile(r"(?i)\b((?:[a-z0-9_]*_)?(?:secret|token|password|passwd|api_?key|access_?key)"
                        r"[a-z0-9_]*[\"']?\s*[=:]\s*[\"']?)(?!\*\*\*)[^\s\"',;]+")
# A field is secret when its name ends like one ("token_refiner.blocks" is not; "session_token" is).
_SECRET_FIELD = re.compile(r"(secret|passw(or)?d|credentials?|token|auth|(api|access|private|secret)[_ -]?key(_id)?)$",
                           re.I)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]+@")
# Absolute paths: a "/" not preceded by a word, ":", "/", "." or "~" (so URL paths and tensor names stay).
_ABS_PATH = re.compile(r"(?<![\w:/.~<>-])/(?:[\w.+@-]+/)+([\w.+@-]+)")
_HOST_FIELDS = {"host", "hostname", "node", "nodename"}
_USER_FIELDS = {"user", "username", "owner", "login"}


class Redactor:
    """Replaces hosts, users, home and absolute paths, and secrets; counts every replacement by category."""

    def __init__(self, hosts: Iterable[str] = (), users: Iterable[str] = (), homes: Iterable[str] = ()) -> None:
        self.hosts = sorted({h for host in hosts if host for h in (host, host.split(".")[0])}, key=len, reverse=True)
        self.users = sorted({u for u in users if u}, key=len, reverse=True)
        self.homes = sorted({h.rstrip("/") for h in homes if h and h.rstrip("/")}, key=len, reverse=True)
        # In free text, names under 3 characters would match inside ordinary words (structured fields always go).
        self._host_res = [re.compile(rf"(?<![A-Za-z0-9-]){re.escape(h)}(?![A-Za-z0-9-])", re.I)
                          for h in self.hosts if len(h) >= 3 and h != "localhost"]
        self._user_res = [re.compile(rf"(?<![A-Za-z0-9_-]){re.escape(u)}(?![A-Za-z0-9_-])") for u in self.users
                          if len(u) >= 3]
        self._home_res = [re.compile(re.escape(h) + r"(?![\w.-])") for h in self.homes]
        self.counts: Counter[str] = Counter()
        self.by_file: dict[str, Counter[str]] = {}
        self._file = "-"

    @classmethod
    def for_this_machine(cls, hosts: Iterable[str] = (), users: Iterable[str] = (),
                         homes: Iterable[str] = ()) -> Redactor:
        """This machine's host, user and home, plus any given (e.g. read from run metadata)."""
        host = socket.gethostname()
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry (some containers)
            user = ""
        return cls([host, socket.getfqdn(), *hosts], [user, *users], [os.path.expanduser("~"), *homes])

    def _sub(self, pattern: re.Pattern[str], repl: str, text: str, category: str) -> str:
        text, n = pattern.subn(repl, text)
        if n:
            self.counts[category] += n
            self.by_file.setdefault(self._file, Counter())[category] += n
        return text

    def text(self, text: str) -> str:
        """One string, redacted."""
        text = self._sub(_AWS_KEY_ID, "<aws-access-key-id>", text, "aws_access_key_id")
        text = self._sub(_AWS_SECRET, "<secret>", text, "secret")
        text = self._sub(_TOKEN, "<token>", text, "token")
        text = self._sub(_BEARER, r"\1<token>", text, "token")
        text = self._sub(_KEY_VALUE, r"\1***", text, "secret")
        text = self._sub(_USERINFO, r"\1***@", text, "url_userinfo")
        for r in self._home_res:
            text = self._sub(r, "~", text, "home_path")
        text = self._sub(_ABS_PATH, r"<path>/\1", text, "absolute_path")
        for r in self._host_res:
            text = self._sub(r, "<host>", text, "host")
        for r in self._user_res:
            text = self._sub(r, "<user>", text, "user")
        return text

    def tree(self, obj: Any, key: str = "") -> Any:
        """A JSON tree: host/user fields and secret-looking fields replaced whole, every string redacted."""
        k = key.lower()
        if isinstance(obj, str) and obj:
            if k in _HOST_FIELDS:
                return self._count("host", "<host>")
            if k in _USER_FIELDS:
                return self._count("user", "<user>")
            if _SECRET_FIELD.search(k):
                return self._count("secret", "***")
            return self.text(obj)
        if isinstance(obj, Mapping):
            return {self.text(str(kk)): self.tree(v, str(kk)) for kk, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.tree(v, key) for v in obj]
        return obj

    def _count(self, category: str, value: str) -> str:
        self.counts[category] += 1
        self.by_file.setdefault(self._file, Counter())[category] += 1
        return value

    def for_file(self, name: str) -> Redactor:
        self._file = name
        return self

    def summary(self) -> dict[str, Any]:
        """redaction.json: what kinds of thing were removed, how often, where (never the removed values)."""
        return {
            "schema": SCHEMA,
            "removed": dict(sorted(self.counts.items())),
            "total": sum(self.counts.values()),
            "by_file": {f: dict(sorted(c.items())) for f, c in sorted(self.by_file.items())},
            "rules": {
                "host": "this machine's host names and every host in run metadata -> <host>",
                "user": "this machine's user and every user in run metadata -> <user>",
                "home_path": "home directories -> ~",
                "absolute_path": "other absolute paths -> <path>/<last component>",
                "aws_access_key_id": "AKIA/ASIA... access key ids -> <aws-access-key-id>",
                "secret": "40-character AWS-style secrets, secret-looking key=value values and fields -> <secret>/***",
                "token": "GitHub/Slack/Hugging Face/bearer tokens -> <token>",
                "url_userinfo": "user:password@ in URLs -> ***@",
            },
            "not_redacted": "report.html is copied byte for byte (tasks.report redacts it when building it); "
                            "tensor records and content hashes are kept",
        }


# -- tests.json ---------------------------------------------------------------------------------------------------


def _rec(suite: str, name: str, outcome: str, skip_reason: str | None = None, **detail: Any) -> dict[str, Any]:
    return {"suite": suite, "name": name, "outcome": outcome, "skip_reason": skip_reason, **detail}


def test_records(verdict: Mapping[str, Any], golden: Mapping[str, Any] | None,
                 ledger: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every gate check, golden test and ledger node as {suite, name, outcome, skip_reason}."""
    ok = lambda passed: "passed" if passed else "failed"  # noqa: E731
    missing = set(verdict.get("missing", ()))
    records = [_rec("gate", "gate/verdict", ok(verdict.get("passed")), gating=True),
               _rec("gate", "gate/golden-tests", ok(verdict.get("golden_passed", golden and golden.get("passed")))),
               _rec("gate", "gate/ledger-complete", ok(not verdict.get("ledger_missing"))),
               _rec("gate", "gate/no-nonfinite", ok(not verdict.get("nonfinite"))),
               _rec("gate", "gate/no-missing-tensors", ok(not missing)),
               _rec("gate", "gate/single-provider-record", ok((verdict.get("single_provider") or {}).get("passed")),
                    gating=False)]
    for t in sorted(verdict.get("tensors", ()), key=lambda t: (t.get("order", 0), t["name"])):
        records.append(_rec("gate", f"tensor/{t['name']}", ok(t.get("passed")), ratio=t.get("ratio"),
                            relative_l2=t.get("relative_l2"), bound=t.get("bound")))
    for name in sorted(missing):
        records.append(_rec("gate", f"tensor/{name}", "failed", missing=True))
    for name in verdict.get("ungated", ()):
        records.append(_rec("gate", f"tensor/{name}", "skipped", "not gated: no provider bound for this tensor"))
    if golden is None:
        records.append(_rec("golden", "golden", "skipped", "golden-tests.json not in the store"))
    for t in (golden or {}).get("tests", ()):
        records.append(_rec("golden", t["name"], t["outcome"], t.get("skip_reason"),
                            candidate_relative_l2=t.get("candidate_relative_l2"), limit=t.get("limit")))
    never_ran = set(ledger.get("missing", ()))
    for block, nodes in sorted(ledger.get("ledger", {}).items()):
        for node, entry in sorted(nodes.items()):
            name = f"{block}/{node}"
            ran = entry.get("forward", 0) > 0 and entry.get("backward", 0) > 0
            if entry.get("fallback"):
                records.append(_rec("ledger", name, "skipped", f"fell back to diffusers: {entry['fallback']}",
                                    forward=entry.get("forward"), backward=entry.get("backward")))
            else:
                records.append(_rec("ledger", name, ok(ran and name not in never_ran),
                                    None if ran else "did not run forward and backward",
                                    forward=entry.get("forward"), backward=entry.get("backward")))
    return records


# -- the bundle ---------------------------------------------------------------------------------------------------


def _read(store: Store, key: str) -> bytes | None:
    path = f"{store.root}/{key}"
    return store.fs.cat_file(path) if store.fs.exists(path) else None


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def public_store_url(store: Store) -> str:
    """The store URL to publish: object-store URLs as they are, a local folder as ``<store>``."""
    return "<store>" if store.url.startswith("file://") else store.url


def blob_link(store: Store, sha: str) -> str:
    return f"{public_store_url(store)}/blobs/sha256/{sha[:2]}/{sha}"


def write_sums(out: Path) -> str:
    """SHA256SUMS over every file under ``out`` except itself; returns its own sha256."""
    lines = [f"{_sha(p.read_bytes())}  {p.relative_to(out).as_posix()}"
             for p in sorted(out.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"]
    data = ("\n".join(lines) + "\n").encode()
    (out / "SHA256SUMS").write_bytes(data)
    return _sha(data)


def verify_sums(out: Path) -> list[str]:
    """Files whose hash does not match SHA256SUMS (or that are missing); empty when the bundle verifies."""
    bad = []
    for line in (out / "SHA256SUMS").read_text().splitlines():
        sha, name = line.split("  ", 1)
        path = out / name
        if not path.is_file() or _sha(path.read_bytes()) != sha:
            bad.append(name)
    return bad


def build_bundle(
    store: Store,
    gate_id: str,
    out: str | Path,
    *,
    logs: Mapping[str, Iterable[str]] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    flow_runs: Mapping[str, str] | None = None,
    redactor: Redactor | None = None,
) -> dict[str, Any]:
    """Write the evidence bundle of ``gate_id`` into ``out``; return {files, sums_sha256, passed, redaction}.

    ``logs``: name -> lines (written redacted to logs/<name>.log); ``extra_metadata``: more metadata to publish
    (redacted into metadata.json); ``flow_runs``: label -> Prefect flow-run URL for SUMMARY.md.
    """
    validate_name(gate_id, single=True, what="gate id")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"evidence folder {out} is not empty; give a new --out folder")
    raw = {name: _read(store, f"runs/{gate_id}/{name}") for name in ("verdict.json", "ledger.json", "report.html")}
    if raw["verdict.json"] is None:
        raise LookupError(f"gate {gate_id!r} has no runs/{gate_id}/verdict.json in {store.url}; run the gate first")
    verdict = json.loads(raw["verdict.json"])
    ledger = json.loads(raw["ledger.json"]) if raw["ledger.json"] is not None else {}
    reference = load_reference(store, verdict["reference_id"])
    golden_raw = _read(store, f"runs/{reference.reference_id}/golden-tests.json")
    golden = json.loads(golden_raw) if golden_raw is not None else None

    runs = {"fp32": reference.fp32_run, **({"fp32-alt": reference.fp32_alt_run} if reference.fp32_alt_run else {}),
            **dict(reference.provider_runs)}
    manifests = {label: store.read_manifest(run_id) for label, run_id in runs.items()}
    # Every host and user any run recorded is redacted everywhere, as are this machine's.
    metas = [m.get("metadata", {}) for m in manifests.values()] + [dict(extra_metadata or {})]
    r = redactor or Redactor.for_this_machine()
    r = Redactor([*r.hosts, *(str(m[k]) for m in metas for k in _HOST_FIELDS if m.get(k))],
                 [*r.users, *(str(m[k]) for m in metas for k in _USER_FIELDS if m.get(k))], r.homes)

    files: dict[str, str] = {}

    def write(name: str, data: str | bytes) -> None:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        files[name] = _sha(path.read_bytes())

    write("verdict.json", _dump(r.for_file("verdict.json").tree(verdict)))
    write("ledger.json", _dump(r.for_file("ledger.json").tree(ledger)))
    if raw["report.html"] is not None:
        write("report.html", raw["report.html"])
    write("tests.json", _dump(r.for_file("tests.json").tree(
        {"schema": SCHEMA, "gate_id": gate_id, "tests": test_records(verdict, golden, ledger)})))
    for label, run_id in runs.items():
        m = manifests[label]
        doc = {"run_id": run_id, "role": label, "manifest_sha256": store.manifest_sha(run_id),
               "manifest_url": blob_link(store, store.manifest_sha(run_id)), "tensors": len(m["tensors"]),
               "identity": m["identity"], "metadata": m.get("metadata", {})}
        name = f"manifests/{run_id}.json"
        write(name, _dump(r.for_file(name).tree(doc)))
    if extra_metadata:
        write("metadata.json", _dump(r.for_file("metadata.json").tree(dict(extra_metadata))))
    for name, lines in (logs or {}).items():
        fname = f"logs/{validate_name(name, single=True, what='log name')}.log"
        r.for_file(fname)
        write(fname, "".join(r.text(line.rstrip("\n")) + "\n" for line in lines))

    links = _links(store, gate_id, reference.reference_id, raw, golden_raw)
    write("SUMMARY.md", r.for_file("SUMMARY.md").text(
        summary_markdown(verdict, golden, ledger, store, links, runs, flow_runs or {}, gate_id)))
    redaction = r.summary()
    write("redaction.json", _dump(redaction))
    sums = write_sums(out)
    return {"out": str(out), "files": files, "sums_sha256": sums, "passed": bool(verdict.get("passed")),
            "redaction": redaction}


def _links(store: Store, gate_id: str, reference_id: str, raw: Mapping[str, bytes | None],
           golden_raw: bytes | None) -> dict[str, str]:
    """Content-addressed links to the gate's documents (the readable copies are the blobs' bytes)."""
    links: dict[str, str] = {}
    docs = {**raw, "golden-tests.json": golden_raw}
    for name in ("reference-manifest.json", "ensemble-rule.json"):
        docs[name] = _read(store, f"runs/{reference_id}/{name}")
    for name, data in docs.items():
        if data is not None:
            sha = _sha(data)
            group = gate_id if name in raw else reference_id
            links[name] = (blob_link(store, sha) if store.has_blob(sha)
                           else f"{public_store_url(store)}/runs/{group}/{name}")
    return links


def summary_markdown(verdict: Mapping[str, Any], golden: Mapping[str, Any] | None, ledger: Mapping[str, Any],
                     store: Store, links: Mapping[str, str], runs: Mapping[str, str],
                     flow_runs: Mapping[str, str], gate_id: str) -> str:
    """The pull-request evidence section."""
    passed = bool(verdict.get("passed"))
    tests = (golden or {}).get("tests", ())
    g_pass = sum(t["outcome"] == "passed" for t in tests)
    nodes = [(b, n, e) for b, ns in ledger.get("ledger", {}).items() for n, e in ns.items()]
    ran = sum(1 for _, _, e in nodes if e.get("forward", 0) > 0 and e.get("backward", 0) > 0 and not e.get("fallback"))
    w = verdict.get("worst")
    link = lambda name: f"[{name}]({links[name]})" if name in links else f"{name} (not stored)"  # noqa: E731
    lines = [
        f"### h3gate evidence: {'PASS' if passed else 'FAIL'}",
        "",
        f"Gate `{gate_id}` against reference `{verdict.get('reference_id')}` "
        f"(providers: {', '.join(verdict.get('providers', ()))}).",
        "",
        "| check | result |",
        "|---|---|",
        f"| verdict | **{'PASS' if passed else 'FAIL'}**: {verdict.get('gated')} tensors gated, "
        f"{len(verdict.get('failures', ()))} failing, {len(verdict.get('missing', ()))} missing, k = "
        f"{_fmt(verdict.get('k'))}, floor {_fmt(verdict.get('floor'))} |",
        "| worst tensor | " + (f"`{w['tensor']}` at {_fmt(w['ratio'])} x its bound |" if w else "none |"),
        f"| golden tests (block 0) | {g_pass} passed, {len(tests) - g_pass} failed |",
        f"| execution ledger | {ran} of {len(nodes)} candidate nodes ran forward and backward; never ran: "
        f"{len(ledger.get('missing', ()))} |",
        "",
        f"Documents (content-addressed in the store `{public_store_url(store)}`): {link('verdict.json')} · "
        f"{link('ledger.json')} · {link('report.html')} · {link('golden-tests.json')} · "
        f"{link('ensemble-rule.json')} · {link('reference-manifest.json')}",
        "",
        "Runs (manifest by hash):",
        "",
    ]
    for label, run_id in runs.items():
        sha = store.manifest_sha(run_id)
        lines.append(f"- {label}: [`{run_id}`]({blob_link(store, sha)})")
    if flow_runs:
        lines += ["", "Prefect flow runs: " + " · ".join(f"[{k}]({v})" for k, v in flow_runs.items())]
    lines += ["", "Bundle: `tests.json`, `redaction.json`, `report.html`, `verdict.json`, `ledger.json`, "
              "`manifests/`; check it with `sha256sum -c SHA256SUMS`.", ""]
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return f"{float(x):.4g}" if isinstance(x, int | float) else str(x)
