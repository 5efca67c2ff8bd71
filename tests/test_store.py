"""tasks/store.py against a local directory and a real S3 endpoint (moto on 127.0.0.1), case for case."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tasks.store import (
    BlobCorrupt,
    BlobMissing,
    BlobRef,
    InvalidName,
    ManifestMissing,
    Store,
    StoreError,
    StoreUnreachable,
    TensorRecord,
    canonical_json,
    make_manifest,
    redact_options,
    validate_name,
)
from tests.s3_server import S3Server, free_port

REPO = Path(__file__).resolve().parents[1]
SECRET = "SUPERSECRET-3f9c1d7e-do-not-print"

@dataclass
class MakeStore:
    """Stores on one fresh location (a tmp dir, or a fresh prefix in the session's moto bucket)."""

    url: str
    options: dict | None = None

    def __call__(self, **kw: object) -> Store:
        return Store(self.url, self.options, **kw)


@pytest.fixture(params=["local", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStore:
    if request.param == "local":
        return MakeStore(str(tmp_path / "store"))
    server: S3Server = request.getfixturevalue("s3_server")
    return MakeStore(f"s3://{server.bucket}/{uuid.uuid4().hex}", server.options())


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store()


def objects(store: Store, under: str = "") -> list[str]:
    """Keys (relative to the root) of every object in the store, optionally under a prefix."""
    root = store.root.rstrip("/") + "/"
    return sorted(p.removeprefix(root) for p in store.fs.find(store.root) if p.startswith(root + under))


def raw(store: Store, key: str) -> str:
    return f"{store.root}/{key}"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def run_with(store: Store, run_id: str, tensors: dict[str, torch.Tensor]) -> dict:
    records = [store.record_tensor(n, t, kind=n.split("/")[0], order=i) for i, (n, t) in enumerate(tensors.items())]
    manifest = make_manifest(run_id, records, {"preset": "tiny"}, {"host": "test"})
    store.write_manifest(run_id, manifest)
    return manifest


TENSORS = {
    "float32": torch.tensor([[1.5, -0.0, float("nan")], [float("inf"), -float("inf"), 1e-45]]),
    "bfloat16": (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 7).to(torch.bfloat16),
    "int64": torch.tensor([-(2**63), 2**63 - 1, 0, 7], dtype=torch.int64),
    "float32-view": torch.arange(24.0).reshape(4, 6).t()[1:3],  # non-contiguous view of a larger storage
    "scalar": torch.tensor(3.25),
    "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
}


def test_tensor_round_trip_is_byte_exact(store: Store) -> None:
    for label, t in TENSORS.items():
        ref, dtype, shape = store.put_tensor(t)
        got = store.get_tensor(ref.sha256, name=label)
        assert (dtype, shape) == (str(t.dtype).removeprefix("torch."), list(t.shape)), label
        assert got.dtype == t.dtype and list(got.shape) == shape, label
        assert torch.equal(bits(got), bits(t)), label  # bit patterns: NaN, -0.0 and subnormals included
        data = store.get_bytes(ref.sha256)
        assert hashlib.sha256(data).hexdigest() == ref.sha256 and len(data) == ref.bytes
    assert TENSORS["bfloat16"].dtype == torch.bfloat16 and store.put_tensor(TENSORS["bfloat16"])[1] == "bfloat16"


def test_identical_content_is_stored_once(store: Store) -> None:
    t = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    a, _, _ = store.put_tensor(t)
    b, _, _ = store.put_tensor(t.clone())  # equal values, different object: same bytes
    assert a == b and objects(store, "blobs/") == [a.key]
    assert store.counters == {"blobs_written": 1, "blobs_skipped": 1, "bytes_written": a.bytes}
    assert store.put_tensor(t.to(torch.bfloat16))[0] != a  # other dtype, other content
    assert store.put_json({"b": 1, "a": [1, 2]}) == store.put_json({"a": [1, 2], "b": 1})
    assert len(objects(store, "blobs/")) == 3 and store.has_blob(a.sha256)


def test_json_is_canonical_and_strict(store: Store) -> None:
    obj = {"z": {"y": [1, 2.5, None, True]}, "a": "ünïcode"}
    ref = store.put_json(obj)
    assert store.get_bytes(ref.sha256) == b'{"a":"\xc3\xbcn\xc3\xafcode","z":{"y":[1,2.5,null,true]}}'
    assert store.get_json(ref.sha256) == obj
    with pytest.raises(StoreError, match="NaN"):
        store.put_json({"x": float("nan")})
    with pytest.raises(StoreError, match="not an h3gate tensor blob"):
        store.get_tensor(ref.sha256)


def test_tampered_blob_is_detected_with_names_and_hashes(store: Store) -> None:
    run_with(store, "r1", {"grad/w": torch.ones(8), "out/sample": torch.zeros(8)})
    rec = store.read_manifest("r1")["tensors"]["grad/w"]
    store.fs.pipe_file(raw(store, BlobRef(rec["sha256"], rec["bytes"]).key), b"tampered bytes")
    actual = hashlib.sha256(b"tampered bytes").hexdigest()
    for get in (store.get_bytes, store.get_tensor, store.get_json):
        with pytest.raises(BlobCorrupt) as err:
            get(rec["sha256"], name="grad/w")
        msg = str(err.value)
        assert rec["sha256"] in msg and actual in msg and "grad/w" in msg
        assert (err.value.expected, err.value.actual, err.value.name) == (rec["sha256"], actual, "grad/w")
    report = store.verify_run("r1")
    assert not report.ok and report.ok_count == 1 and report.missing == []
    assert report.corrupt == [("grad/w", rec["sha256"], actual)]
    with pytest.raises(BlobCorrupt, match="grad/w") as err:
        report.raise_for_errors()
    assert actual in str(err.value)


def test_missing_blob_is_reported_by_name(store: Store) -> None:
    run_with(store, "r1", {"out/sample": torch.zeros(3), "grad/b": torch.ones(3)})
    sha = store.read_manifest("r1")["tensors"]["grad/b"]["sha256"]
    store.fs.rm(raw(store, BlobRef(sha, 0).key))
    assert not store.has_blob(sha)
    with pytest.raises(BlobMissing, match="grad/b") as err:
        store.get_tensor(sha, name="grad/b")
    assert sha in str(err.value) and err.value.sha256 == sha
    report = store.verify_run("r1")
    assert (report.ok, report.ok_count, report.missing, report.first) == (False, 1, [("grad/b", sha)], "grad/b")
    with pytest.raises(BlobMissing, match="grad/b"):
        report.raise_for_errors()
    with pytest.raises(BlobMissing):
        store.get_bytes("0" * 64)


def test_write_manifest_refuses_absent_blob(store: Store) -> None:
    real = store.record_tensor("grad/a", torch.ones(2), kind="grad", order=0)
    ghost = TensorRecord("grad/ghost", "grad", 1, "ab" * 32, 10, "float32", [2])
    with pytest.raises(BlobMissing, match="grad/ghost") as err:
        store.write_manifest("r1", make_manifest("r1", [real, ghost], {}, {}))
    assert err.value.name == "grad/ghost"
    assert not store.has_manifest("r1") and store.list_runs() == [] and objects(store, "runs/") == []
    with pytest.raises(ManifestMissing, match="r1"):
        store.read_manifest("r1")


def test_manifest_round_trip_hash_and_immutability(store: Store) -> None:
    manifest = run_with(store, "r1", {"out/sample": torch.ones(4), "grad/x": torch.ones(4)})
    data = canonical_json(manifest)
    ref = store.manifest_ref("r1")
    assert ref == BlobRef(hashlib.sha256(data).hexdigest(), len(data)) and store.get_json(ref.sha256) == manifest
    assert store.read_manifest("r1") == manifest and store.list_runs() == ["r1"] and store.has_manifest("r1")
    assert store.write_manifest("r1", manifest) == ref  # same content again: a no-op
    rec = TensorRecord.from_json(manifest["tensors"]["grad/x"], "grad/x")
    assert rec.to_json() == {"name": "grad/x", **manifest["tensors"]["grad/x"]}
    assert TensorRecord.from_json(rec.to_json()) == rec and rec.ref.sha256 == rec.sha256
    changed = {**manifest, "identity": {"preset": "small"}}
    with pytest.raises(StoreError, match="different manifest"):
        store.write_manifest("r1", changed)
    store.write_manifest("r1", changed, overwrite=True)
    assert store.read_manifest("r1")["identity"] == {"preset": "small"}
    run_with(store, "r0", {"out/sample": torch.ones(4)})
    assert store.list_runs() == ["r0", "r1"] and store.verify_run("r1").ok


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m["tensors"]["grad/x"].pop("dtype"), "exactly the fields"),
        (lambda m: m["tensors"]["grad/x"].update(order=0), "share order"),
        (lambda m: m["tensors"]["grad/x"].update(shape=[2, -1]), "shape"),
        (lambda m: m["tensors"]["grad/x"].update(bytes=True), "'bytes' must be int"),
        (lambda m: m["tensors"].update({"grad/../x": m["tensors"].pop("grad/x")}), "invalid tensor name"),
        (lambda m: m.pop("identity"), "'identity'"),
        (lambda m: m.update(run_id="other"), "make them agree"),
    ],
)
def test_manifest_validation(tmp_path: Path, change: Callable[[dict], object], match: str) -> None:
    store = Store(tmp_path / "s")
    recs = [store.record_tensor(n, torch.ones(2), kind="grad", order=i) for i, n in enumerate(["grad/w", "grad/x"])]
    manifest = json.loads(json.dumps(make_manifest("r1", recs, {}, {})))
    change(manifest)
    with pytest.raises(StoreError, match=match):
        store.write_manifest("r1", manifest)
    assert not store.has_manifest("r1")


def test_interrupted_run_leaves_no_manifest_and_resumes(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()
    n = 40
    writer = (
        "import sys, time, torch\n"
        "from tasks.store import Store, make_manifest\n"
        "store = Store.from_env()\n"
        f"recs = []\nfor i in range({n}):\n"
        "    recs.append(store.record_tensor(f'grad/p.{i}', torch.full((512,), float(i)), kind='grad', order=i))\n"
        "    print(i, flush=True)\n    time.sleep(0.02)\n"
        "store.write_manifest('r1', make_manifest('r1', recs, {}, {}))\nprint('done', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "H3GATE_STORE": make_store.url,  # what a worker process gets
           "H3GATE_STORAGE_OPTIONS": json.dumps(make_store.options or {})}
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "9":
            proc.kill()  # SIGKILL mid-run: no cleanup, no manifest
            break
    proc.wait(timeout=30)
    assert proc.returncode == -9
    assert not store.has_manifest("r1") and store.list_runs() == []
    done = len(objects(store, "blobs/"))
    assert 10 <= done < n
    store.fs.pipe_file(raw(store, "tmp/leftover.part"), b"\x00partial")  # a writer's half-written staging file
    rerun = make_store()
    records = [rerun.record_tensor(f"grad/p.{i}", torch.full((512,), float(i)), kind="grad", order=i) for i in range(n)]
    rerun.write_manifest("r1", make_manifest("r1", records, {}, {}))
    assert rerun.counters["blobs_skipped"] == done and rerun.counters["blobs_written"] == n - done + 1  # + manifest
    report = rerun.verify_run("r1")
    assert report.ok and report.ok_count == n and rerun.list_runs() == ["r1"]


BAD_NAMES = ["", "..", "a/../b", "./a", "/abs", "~/x", "s3://x", "C:/x", "a//b", "a/", "a\\b", "a\x00b", "a\nb",
             "x*", "x[0]", "a" * 513, "a\x7fb"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_malformed_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_name(name)
    with pytest.raises(ValueError):  # InvalidName is also a ValueError
        validate_name(name, single=True)


def test_names_checked_at_every_entry_point(store: Store) -> None:
    for ok in ["grad/transformer_blocks.3.attn.to_q.weight", "out/sample", "fwd/transformer_blocks.39", "a-b_c.d"]:
        assert validate_name(ok) == ok
    with pytest.raises(InvalidName, match="single part"):
        validate_name("runs/x", single=True)
    for call in (
        lambda: store.write_ref("..", "x", {}),
        lambda: store.write_ref("ns", "a/b", {}),
        lambda: store.read_ref("ns", "/etc"),
        lambda: store.list_refs("s3://bucket"),
        lambda: store.read_manifest("../r"),
        lambda: store.has_manifest("a\\b"),
        lambda: store.get_bytes("../" + "a" * 61),
        lambda: store.record_tensor("grad//w", torch.ones(1), kind="grad", order=0),
    ):
        with pytest.raises(InvalidName):
            call()
    assert objects(store) == []


@given(st.text(max_size=40))
def test_accepted_names_cannot_escape(name: str) -> None:
    try:
        validate_name(name)
    except InvalidName:
        return
    parts = name.split("/")
    assert all(p not in ("", ".", "..") for p in parts) and not name.startswith("/")
    assert not any(c in name for c in "\\:*?[]") and all(ord(c) >= 32 for c in name)


def test_refs_round_trip(store: Store) -> None:
    assert store.read_ref("reference", "tiny") is None and store.list_refs("reference") == []
    store.write_ref("reference", "tiny", {"run_id": "r1", "manifest": "ab" * 32})
    store.write_ref("reference", "small", {"run_id": "r2"})
    assert store.read_ref("reference", "tiny") == {"run_id": "r1", "manifest": "ab" * 32}
    store.write_ref("reference", "tiny", {"run_id": "r3"})  # refs are mutable pointers
    assert store.read_ref("reference", "tiny") == {"run_id": "r3"}
    assert store.list_refs("reference") == ["small", "tiny"] and store.list_refs("other") == []
    with pytest.raises(StoreError, match="must be a dict"):
        store.write_ref("reference", "x", ["not", "a", "dict"])  # type: ignore[arg-type]


def test_documents_and_aliases(store: Store) -> None:
    doc = {"tensors": ["out/sample"], "k": 1.1}
    ref = store.write_document("tiny-cpu-abc", "reference-manifest.json", doc)
    assert store.get_json(ref.sha256) == doc == store.read_document("tiny-cpu-abc", "reference-manifest.json")
    assert store.read_document("tiny-cpu-abc", "other.json") is None and store.list_runs() == []
    for bad in ("manifest.json", "x.txt", "a/b.json"):
        with pytest.raises(InvalidName):
            store.write_document("g", bad, {})
    before = store.bytes_written
    run_with(store, "r1", {"out/sample": torch.ones(2)})
    assert store.bytes_written > before and store.manifest_sha("r1") == store.manifest_ref("r1").sha256


def test_urls_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Store("rel").url == f"file://{(tmp_path / 'rel').as_posix()}"
    assert Store(f"file://{tmp_path}/f").url == f"file://{tmp_path}/f"
    mem = Store(f"memory://h3gate-{uuid.uuid4().hex}")
    assert mem.get_json(mem.put_json({"k": 1}).sha256) == {"k": 1} and mem.url.startswith("memory://")
    monkeypatch.setenv("H3GATE_STORE", str(tmp_path / "env"))
    monkeypatch.setenv("H3GATE_STORAGE_OPTIONS", json.dumps({"auto_mkdir": True}))
    assert Store.from_env().url == f"file://{tmp_path}/env"
    monkeypatch.setenv("H3GATE_STORAGE_OPTIONS", '{"secret": "' + SECRET + '",')  # broken JSON holding a secret
    with pytest.raises(StoreError, match="H3GATE_STORAGE_OPTIONS is not valid JSON") as err:
        Store.from_env()
    assert SECRET not in str(err.value)


def _full_text(exc: BaseException) -> str:
    return str(exc) + repr(exc) + "".join(traceback.format_exception(exc))


def test_secret_never_appears_even_when_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    options = {"key": "AKIA-TEST-KEY", "secret": SECRET, "client_kwargs": {"endpoint_url": dead}}
    caplog.set_level(logging.DEBUG)  # every logger, botocore and s3fs included
    store = Store("s3://h3gate-test/prefix/", options)  # default retries and backoff
    start = time.monotonic()
    with pytest.raises(StoreUnreachable) as err:
        store.put_tensor(torch.ones(3))
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"a dead endpoint must fail in seconds, took {elapsed:.1f}s"
    text = _full_text(err.value)
    assert "s3://h3gate-test/prefix" in text and "127.0.0.1" in text and "4 time(s)" in text
    assert "retrying" in caplog.text  # the retries were logged, so the next check is not vacuous
    redacted = redact_options(options)
    assert redacted == {"key": "***", "secret": "***", "client_kwargs": {"endpoint_url": dead}}
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tasks."))
    for where in (text, repr(store), store.url, ours, json.dumps(redacted)):
        assert SECRET not in where and "AKIA-TEST-KEY" not in where
    # botocore's own DEBUG log shows the access key id in the Authorization header (AWS: an identifier, not a
    # secret); the secret key itself must appear nowhere, whoever logged
    assert SECRET not in caplog.text
    assert store.url == "s3://h3gate-test/prefix"
    with pytest.raises(StoreError, match="query or fragment") as err:
        Store(f"s3://bucket/x?sig={SECRET}")
    assert SECRET not in _full_text(err.value)
    with pytest.raises(StoreError, match="contains credentials") as err:
        Store(f"s3://user:{SECRET}@bucket/x")
    assert SECRET not in _full_text(err.value)
    masked = redact_options({"client_kwargs": {"endpoint_url": f"http://u:{SECRET}@host"}, "token": SECRET})
    assert SECRET not in json.dumps(masked)


def test_outage_fails_fast_then_recovers_on_same_port() -> None:
    server = S3Server(bucket="h3gate-outage").start()
    try:
        server.create_bucket()
        store = Store(f"s3://{server.bucket}/run", server.options(secret=SECRET), retries=2, backoff_s=0.1)
        before = store.put_tensor(torch.ones(16))[0]
        server.stop()
        start = time.monotonic()
        with pytest.raises(StoreUnreachable) as err:
            store.put_tensor(torch.zeros(16))
        assert time.monotonic() - start < 5
        assert err.value.url == store.url and "3 time(s)" in str(err.value) and SECRET not in _full_text(err.value)
        server.start()  # same port: the endpoint comes back, moto kept its objects
        after = store.put_tensor(torch.zeros(16))[0]
        assert store.get_tensor(after.sha256).sum() == 0 and store.get_tensor(before.sha256).sum() == 16
    finally:
        server.stop()
