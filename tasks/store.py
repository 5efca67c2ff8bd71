"""Content-addressed artifact store over fsspec: blobs, run manifests, named refs (DESIGN 5).

Layout under the root URL (plain local path, file://..., s3://bucket/prefix, memory://...):

    blobs/sha256/<aa>/<sha256>     immutable content: safetensors bytes of {"tensor": t}, or canonical JSON
    runs/<run_id>/manifest.json    {"run_id", "tensors": {name: record}, "identity", "metadata"} (canonical JSON)
    runs/<group>/<doc>.json        readable copies of JSON documents (write_document) that are also blobs
    refs/<namespace>/<name>.json   named, mutable pointers (canonical JSON objects)
    tmp/                           local staging for atomic writes; safe to delete while no writer runs

- Content addressing: a blob's key is the SHA-256 of its bytes. put_* skips the write when a blob with that key and
  the same size exists (resume + dedupe); puts trust a present blob of the right size, reads and verify_run re-hash.
- Tensors: safetensors bytes of {"tensor": t.detach().contiguous().cpu()} without metadata, so equal values, dtype
  and shape give equal bytes. JSON: sort_keys, separators (",", ":"), UTF-8, no NaN/Infinity. Nothing is pickled.
- Atomic writes. Local filesystem: write and fsync tmp/<uuid>.part, then os.replace into place (same filesystem, so
  readers see all of an object or none of it). Object stores (s3, gcs, azure, memory): one direct write of the final
  key. An S3 PUT is atomic per object, and so is a multipart upload (visible only at CompleteMultipartUpload), so a
  tmp key plus server-side copy would only double the requests and bytes moved (and copies over 5 GB need multipart
  copy). A killed multipart upload leaves invisible parts: give the bucket an AbortIncompleteMultipartUpload rule.
  Other fsspec filesystems: tmp key, then mv.
- Manifest last: write_manifest checks that every referenced blob exists with the recorded size (BlobMissing
  otherwise, nothing written), stores the manifest bytes as a blob (its hash is "the manifest hash"), then writes
  runs/<run_id>/manifest.json. An interrupted run leaves no manifest; its rerun skips the blobs already present.
  Manifests are immutable: replacing one with different content needs overwrite=True.
- Reads verify SHA-256 (verify_run streams). BlobCorrupt names key, tensor, expected and actual hash; BlobMissing
  names key and tensor.
- Names (validate_name): tensor names are "/"-separated parts; run ids, ref namespaces and ref names are one part.
  Refused: empty, empty/"."/".." parts, absolute paths, ":" (URL schemes, drive letters), backslashes, control
  characters, glob characters *?[], more than 512 characters.
- Retries: every storage call is retried `retries` times with exponential backoff (backoff_s, x2, x4, ...) on
  transient errors (OSError other than not-found/exists/permission, hence ConnectionError and TimeoutError; botocore
  connection and HTTP errors), then StoreUnreachable. Corrupt blobs, invalid names, permission and credential errors
  are never retried. For s3 the defaults are connect_timeout 3 s, read_timeout 30 s, botocore total_max_attempts 1 and
  s3fs's inner retry loop off, so this loop is the single, logged retry policy and a dead endpoint fails in about
  the sum of the backoffs (3.5 s by default), not minutes. Options given by the caller win.
- Secrets: storage options are never echoed. `url` has no userinfo, query or fragment (URLs with user:password@, ? or
  # are refused); messages and log lines have every secret option value replaced by ***; repr shows redact_options().
  Storage errors are re-raised `from None` with a scrubbed cause, so no traceback carries the raw one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

try:  # s3 is an optional extra; without botocore there are no botocore errors to classify
    from botocore.exceptions import BotoCoreError
    from botocore.exceptions import ConnectionError as _BotoConnectionError
    from botocore.exceptions import HTTPClientError as _BotoHTTPClientError

    _TRANSIENT_EXTRA: tuple[type[BaseException], ...] = (_BotoConnectionError, _BotoHTTPClientError)
    _WRAPPED: tuple[type[BaseException], ...] = (OSError, BotoCoreError)
except ImportError:  # pragma: no cover
    _TRANSIENT_EXTRA, _WRAPPED = (), (OSError,)

log = logging.getLogger(__name__)
T = TypeVar("T")

_SHA_RE = re.compile(r"[0-9a-f]{64}")
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://([^/?#]*)")
_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@]*@")
_SECRET_KEY_RE = re.compile(r"key|secret|token|passw|credential|auth|session|signature|sas|connection_str", re.I)
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"}
_PERMANENT_OS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_RECORD_FIELDS: dict[str, type] = {"kind": str, "order": int, "sha256": str, "bytes": int, "dtype": str, "shape": list}
_MAX_NAME = 512  # S3 keys are at most 1024 bytes: leave room for the root prefix and the layout
_CHUNK = 8 << 20  # streaming-hash read size: amortises per-read overhead, small next to a large tensor


class StoreError(RuntimeError):
    """Base of every store failure; the message names the object and says what to do. Keywords become attributes."""

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.__dict__.update(attrs)


class BlobMissing(StoreError):
    """A blob is absent; attributes sha256 and name (the tensor, when known)."""


class BlobCorrupt(StoreError):
    """A blob's bytes do not hash to its key; attributes sha256 (= expected), expected, actual and name."""


class StoreUnreachable(StoreError):
    """Storage I/O kept failing after bounded retries; attributes url (redacted) and cause (scrubbed)."""


class InvalidName(StoreError, ValueError):
    """A tensor name, run id, ref name or hash that could escape the layout or be misread as a URL."""


class ManifestMissing(StoreError):
    """A run has no manifest: it never finished, or the run id is wrong."""


def validate_name(name: str, *, single: bool = False, what: str = "name") -> str:
    """Return `name` if it is a safe store name, else raise InvalidName; `single` forbids "/" (one path part)."""
    why = None
    if not isinstance(name, str) or not name:
        why = "it is empty or not a string"
    elif len(name) > _MAX_NAME:
        why = f"it is longer than {_MAX_NAME} characters"
    elif any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        why = "it contains control characters"
    elif "\\" in name:
        why = "it contains a backslash"
    elif ":" in name:
        why = "it contains ':' (URL scheme or drive letter)"
    elif name.startswith(("/", "~")):
        why = "it is an absolute path"
    elif any(c in name for c in "*?[]"):
        why = "it contains glob characters"
    elif any(p in ("", ".", "..") for p in name.split("/")):
        why = "it has an empty, '.' or '..' part"
    elif single and "/" in name:
        why = "it must be a single part (no '/')"
    if why:
        raise InvalidName(f"invalid {what} {name!r}: {why}; use '/'-separated parts of letters, digits and '._-'")
    return name


def blob_key(sha256: str) -> str:
    """Key of a blob relative to the store root (raises InvalidName for a malformed hash)."""
    if not isinstance(sha256, str) or not _SHA_RE.fullmatch(sha256):
        raise InvalidName(f"invalid sha256 {sha256!r}: expected 64 lowercase hex digits (a BlobRef.sha256)")
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: equal content gives equal bytes, hence an equal hash."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise StoreError(f"cannot store value as JSON ({exc}); use dict/list/str/int/float/bool/None, string keys "
                         "and finite floats (encode NaN/Infinity as strings)") from None


def redact_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Storage options safe to print: secret-looking keys become '***', URL userinfo is masked, objects named."""

    def walk(value: Any, secret: bool) -> Any:
        if secret and value not in (None, "", False):
            return "***"
        if isinstance(value, dict):
            return {str(k): walk(v, bool(_SECRET_KEY_RE.search(str(k)))) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, False) for v in value]
        if isinstance(value, str):
            return _USERINFO_RE.sub(r"\1***@", value)
        return value if value is None or isinstance(value, bool | int | float) else f"<{type(value).__name__}>"

    return walk(dict(options or {}), False)


def _secret_values(value: Any, secret: bool = False) -> set[str]:
    if isinstance(value, dict):
        return set().union(*(_secret_values(v, secret or bool(_SECRET_KEY_RE.search(str(k))))
                             for k, v in value.items()))
    if isinstance(value, list | tuple):
        return set().union(*(_secret_values(v, secret) for v in value))
    return {value} if secret and isinstance(value, str) and len(value) >= 4 else set()


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _label(sha: str, name: str | None) -> str:
    return f"blob {blob_key(sha)}" + (f" (tensor {name!r})" if name else "")


def _missing(url: str, sha: str, name: str | None) -> BlobMissing:
    return BlobMissing(f"{_label(sha, name)} is missing from store {url}; rerun the run that produced it (present "
                       "blobs are skipped) or restore the store", sha256=sha, name=name)


def _corrupt(url: str, sha: str, actual: str, name: str | None) -> BlobCorrupt:
    return BlobCorrupt(f"{_label(sha, name)} in store {url} is corrupt: expected sha256 {sha}, actual {actual}; "
                       "delete it and rerun the run that produced it",
                       sha256=sha, expected=sha, actual=actual, name=name)


@dataclass(frozen=True)
class BlobRef:
    """A stored blob: its SHA-256 and size in bytes."""

    sha256: str
    bytes: int

    @property
    def key(self) -> str:
        return blob_key(self.sha256)


@dataclass(frozen=True)
class TensorRecord:
    """One captured tensor as a manifest records it (DESIGN 4: kind, name, execution order)."""

    name: str
    kind: str
    order: int
    sha256: str
    bytes: int
    dtype: str
    shape: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "order": self.order, "sha256": self.sha256,
                "bytes": self.bytes, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: dict[str, Any], name: str | None = None) -> TensorRecord:
        """From to_json() output, or from a manifest record (without "name") plus its name."""
        rec = dict(obj)
        name = rec.pop("name", None) if name is None else name
        _check_record(validate_name(name, what="tensor name"), rec)
        return cls(name=name, **rec)

    @property
    def ref(self) -> BlobRef:
        return BlobRef(self.sha256, self.bytes)


def _check_record(name: str, rec: Any) -> None:
    where = f"manifest record of tensor {name!r}"
    if not isinstance(rec, dict) or set(rec) != set(_RECORD_FIELDS):
        got = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise StoreError(f"{where} must have exactly the fields {sorted(_RECORD_FIELDS)}, got {got}")
    for key, typ in _RECORD_FIELDS.items():
        if not isinstance(rec[key], typ) or isinstance(rec[key], bool):
            raise StoreError(f"{where}: {key!r} must be {typ.__name__}, got {type(rec[key]).__name__}")
    if rec["order"] < 0 or rec["bytes"] < 0 or not rec["kind"] or not rec["dtype"]:
        raise StoreError(f"{where}: order and bytes must be >= 0, kind and dtype non-empty")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in rec["shape"]):
        raise StoreError(f"{where}: shape must be a list of non-negative ints, got {rec['shape']!r}")
    blob_key(rec["sha256"])


def validate_manifest(manifest: Any, run_id: str | None = None) -> dict[str, Any]:
    """Check a manifest's keys, names, records and unique execution orders; return it."""
    if not isinstance(manifest, dict) or not {"run_id", "tensors", "identity", "metadata"} <= set(manifest):
        raise StoreError("a manifest must be a dict with 'run_id', 'tensors', 'identity' and 'metadata'")
    rid = validate_name(manifest["run_id"], single=True, what="run id")
    if run_id is not None and rid != run_id:
        raise StoreError(f"manifest says run_id {rid!r} but is stored as run {run_id!r}; make them agree")
    if not all(isinstance(manifest[k], dict) for k in ("tensors", "identity", "metadata")):
        raise StoreError(f"manifest of run {rid!r}: 'tensors', 'identity' and 'metadata' must be dicts")
    orders: dict[int, str] = {}
    for name, rec in manifest["tensors"].items():
        _check_record(validate_name(name, what="tensor name"), rec)
        if (other := orders.setdefault(rec["order"], name)) != name:
            raise StoreError(f"manifest of run {rid!r}: tensors {other!r} and {name!r} share order {rec['order']}")
    return manifest


def make_manifest(run_id: str, records: Iterable[TensorRecord], identity: dict[str, Any],
                  metadata: dict[str, Any]) -> dict[str, Any]:
    """A validated manifest dict; identity is content identity, metadata (time, host, user) is not."""
    tensors: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.name in tensors:
            raise StoreError(f"tensor {rec.name!r} recorded twice in run {run_id!r}; capture each name once")
        tensors[rec.name] = {k: v for k, v in rec.to_json().items() if k != "name"}
    return validate_manifest({"run_id": run_id, "tensors": tensors, "identity": identity, "metadata": metadata})


@dataclass
class VerifyReport:
    """Result of re-hashing every blob of a run; `first` is the first bad tensor in execution order."""

    run_id: str
    ok_count: int = 0
    missing: list[tuple[str, str]] = field(default_factory=list)
    corrupt: list[tuple[str, str, str]] = field(default_factory=list)
    first: str | None = None
    store_url: str = ""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.corrupt

    def raise_for_errors(self) -> None:
        """Raise BlobCorrupt or BlobMissing for the first bad tensor in execution order, if any."""
        bad = [(n, s, a) for n, s, a in self.corrupt if n == self.first] + [(n, s, None) for n, s in self.missing]
        if self.ok or not bad:
            return
        name, sha, actual = bad[0]
        where = f"run {self.run_id!r} ({len(self.corrupt)} corrupt, {len(self.missing)} missing) in {self.store_url}"
        raise _missing(where, sha, name) if actual is None else _corrupt(where, sha, actual, name)


class Store:
    """Content-addressed store rooted at an fsspec URL; the module docstring is the contract."""

    def __init__(self, url: str = "./h3store", storage_options: dict[str, Any] | None = None, *,
                 retries: int = 3, backoff_s: float = 0.5) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries ({retries}) and backoff_s ({backoff_s}) must be >= 0")
        self._options = dict(storage_options or {})
        self._secrets = _secret_values(self._options)
        self._retries, self._backoff_s = retries, backoff_s
        self.counters = {"blobs_written": 0, "blobs_skipped": 0, "bytes_written": 0}
        url = os.fspath(url)
        safe, m = _USERINFO_RE.sub(r"\1***@", url), _URL_RE.match(url)
        if m and "@" in m.group(2):
            raise StoreError(f"store URL {safe} contains credentials (user:password@); pass them as storage options "
                             "or through the environment instead")
        if m and ("?" in url or "#" in url):
            raise StoreError(f"store URL {re.split('[?#]', safe)[0]}... has a query or fragment, which "
                             "fsspec would make part of every key; pass such settings as storage options")
        protocol = m.group(1).lower() if m else "file"
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **_with_defaults(protocol, self._options))
        except ImportError as exc:
            raise StoreError(f"store {safe} needs package {exc.name!r}; for s3 install h3gate[s3]") from None
        except (ValueError, TypeError, OSError) as exc:
            raise StoreError(f"cannot open store {safe} ({self._scrub(exc)}); check the URL and options") from None
        if protocol in ("s3", "s3a"):
            self._fs.retries = 1  # s3fs's inner loop off: ours is the single, logged retry policy
        self._root = root.rstrip("/")
        self._local = isinstance(self._fs, LocalFileSystem)
        self._direct = not self._local and protocol in _OBJECT_STORES
        self._url = f"file://{self._root}" if self._local else url.rstrip("/")

    @classmethod
    def from_env(cls, url: str | None = None, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> Store:
        """Store from arguments, falling back to H3GATE_STORE and H3GATE_STORAGE_OPTIONS (a JSON object)."""
        url = url or os.environ.get("H3GATE_STORE") or "./h3store"
        if storage_options is None and (raw := os.environ.get("H3GATE_STORAGE_OPTIONS")):
            try:
                storage_options = json.loads(raw)
            except json.JSONDecodeError as exc:  # never echo the value: it may hold credentials
                raise StoreError(f"H3GATE_STORAGE_OPTIONS is not valid JSON (line {exc.lineno}, column {exc.colno}); "
                                 "set it to a JSON object of fsspec storage options") from None
            if not isinstance(storage_options, dict):
                raise StoreError("H3GATE_STORAGE_OPTIONS must be a JSON object of fsspec storage options")
        return cls(url, storage_options, **kwargs)

    @property
    def url(self) -> str:
        """Root URL, safe to print and to hand to another process (which brings its own storage options)."""
        return self._url

    @property
    def storage_options(self) -> dict[str, Any]:
        """A copy of the storage options, secrets included: for a child process's stdin, never for a log."""
        return dict(self._options)

    @property
    def root(self) -> str:
        """Filesystem-specific root path, for direct use with `fs`."""
        return self._root

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._fs

    @property
    def bytes_written(self) -> int:
        """Blob bytes this Store object wrote (skipped blobs excluded)."""
        return self.counters["bytes_written"]

    def __repr__(self) -> str:
        return f"Store(url={self._url!r}, storage_options={redact_options(self._options)!r})"

    # -- blobs ---------------------------------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> BlobRef:
        """Store bytes under their SHA-256; skip the write when a blob of that hash and size is present."""
        ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        if self._size(ref.key) == ref.bytes:
            self.counters["blobs_skipped"] += 1
            return ref
        self._write(ref.key, data)
        self.counters["blobs_written"] += 1
        self.counters["bytes_written"] += ref.bytes
        return ref

    def get_bytes(self, sha256: str, *, name: str | None = None) -> bytes:
        """A blob's bytes, verified against its SHA-256."""
        if (data := self._read(blob_key(sha256))) is None:
            raise _missing(self.url, sha256, name)
        if (actual := hashlib.sha256(data).hexdigest()) != sha256:
            raise _corrupt(self.url, sha256, actual, name)
        return data

    def has_blob(self, sha256: str) -> bool:
        return self._size(blob_key(sha256)) is not None

    def put_tensor(self, tensor: torch.Tensor, *, name: str | None = None) -> tuple[BlobRef, str, list[int]]:
        """Store a tensor as deterministic safetensors bytes; return (ref, dtype string, shape)."""
        t = tensor.detach().contiguous().cpu()
        try:
            data = _st_save({"tensor": t})
        except Exception as exc:  # unsupported dtype or layout: say which tensor
            raise StoreError(f"cannot serialise tensor {name or '(unnamed)'} ({_dtype_str(t.dtype)}, {list(t.shape)}) "
                             f"with safetensors ({exc}); convert it to a supported dense dtype") from None
        return self.put_bytes(data), _dtype_str(t.dtype), list(t.shape)

    def get_tensor(self, sha256: str, *, name: str | None = None, device: str = "cpu") -> torch.Tensor:
        """A verified tensor blob, moved to `device`."""
        data = self.get_bytes(sha256, name=name)
        try:
            tensors = _st_load(data)
        except Exception:  # safetensors raises its own error types for non-safetensors bytes
            tensors = {}
        if set(tensors) != {"tensor"}:
            raise StoreError(f"{_label(sha256, name)} is not an h3gate tensor blob; it may be JSON (use get_json) "
                             "or the manifest points at the wrong hash")
        return tensors["tensor"].to(device)

    def record_tensor(self, name: str, tensor: torch.Tensor, *, kind: str, order: int) -> TensorRecord:
        """put_tensor plus its manifest record."""
        ref, dtype, shape = self.put_tensor(tensor, name=validate_name(name, what="tensor name"))
        return TensorRecord(name, kind, order, ref.sha256, ref.bytes, dtype, shape)

    def put_json(self, obj: Any) -> BlobRef:
        return self.put_bytes(canonical_json(obj))

    def get_json(self, sha256: str, *, name: str | None = None) -> Any:
        return self._parse(self.get_bytes(sha256, name=name), _label(sha256, name))

    # -- runs ----------------------------------------------------------------------------------------------------
    def write_manifest(self, run_id: str, manifest: dict[str, Any], *, overwrite: bool = False) -> BlobRef:
        """Write a run's manifest, after checking all its blobs exist; return its blob ref (the manifest hash)."""
        validate_manifest(manifest, validate_name(run_id, single=True, what="run id"))
        self._check_blobs(run_id, manifest["tensors"])
        data, key = canonical_json(manifest), f"runs/{run_id}/manifest.json"
        existing = self._read(key)
        if existing is not None and existing != data and not overwrite:
            raise StoreError(f"run {run_id!r} already has a different manifest in {self.url} (sha256 "
                             f"{hashlib.sha256(existing).hexdigest()}); use a new run id, or overwrite=True")
        ref = self.put_bytes(data)
        if existing != data:
            self._write(key, data)
        return ref

    def read_manifest(self, run_id: str) -> dict[str, Any]:
        return validate_manifest(self._parse(self._manifest_bytes(run_id), f"manifest of run {run_id!r}"), run_id)

    def manifest_ref(self, run_id: str) -> BlobRef:
        """Ref of the stored manifest bytes (the manifest hash)."""
        data = self._manifest_bytes(run_id)
        return BlobRef(hashlib.sha256(data).hexdigest(), len(data))

    def manifest_sha(self, run_id: str) -> str:
        return self.manifest_ref(run_id).sha256

    def has_manifest(self, run_id: str) -> bool:
        return self._size(f"runs/{validate_name(run_id, single=True, what='run id')}/manifest.json") is not None

    def list_runs(self) -> list[str]:
        return sorted(p.rstrip("/").split("/")[-2] for p in self._glob("runs/*/manifest.json"))

    def verify_run(self, run_id: str, *, workers: int | None = None) -> VerifyReport:
        """Re-hash (streaming) every blob of a run's manifest; a blob shared by tensors is hashed once.

        ``workers`` threads hash at once (default: one per CPU, at most 16; hashlib releases the GIL): the
        gate re-hashes every run of a reference (36 GB at the block preset, 18 s with 4 threads on the H200 host).
        """
        workers = workers or min(16, os.cpu_count() or 4)
        items = sorted(self.read_manifest(run_id)["tensors"].items(), key=lambda kv: kv[1]["order"])
        shas = list(dict.fromkeys(rec["sha256"] for _, rec in items))
        with ThreadPoolExecutor(max(1, workers)) as pool:
            actual = dict(zip(shas, pool.map(self._hash_blob, shas), strict=True))
        report = VerifyReport(run_id, store_url=self.url)
        for name, rec in items:
            sha, got = rec["sha256"], actual[rec["sha256"]]
            if got == sha:
                report.ok_count += 1
                continue
            report.first = report.first or name
            report.missing.append((name, sha)) if got is None else report.corrupt.append((name, sha, got))
        return report

    def write_document(self, group: str, filename: str, obj: Any) -> BlobRef:
        """Store a JSON document as a blob and keep a readable copy at runs/<group>/<filename>; return the blob."""
        key = self._doc_key(group, filename)
        ref = self.put_json(obj)
        self._write(key, canonical_json(obj))
        return ref

    def read_document(self, group: str, filename: str) -> Any | None:
        data = self._read(key := self._doc_key(group, filename))
        return None if data is None else self._parse(data, f"document {key}")

    # -- refs ----------------------------------------------------------------------------------------------------
    def write_ref(self, namespace: str, name: str, obj: dict[str, Any]) -> None:
        if not isinstance(obj, dict):
            raise StoreError(f"ref {namespace}/{name} must be a dict, got {type(obj).__name__}")
        self._write(self._ref_key(namespace, name), canonical_json(obj))

    def read_ref(self, namespace: str, name: str) -> dict[str, Any] | None:
        data = self._read(key := self._ref_key(namespace, name))
        return None if data is None else self._parse(data, f"ref {key}")

    def list_refs(self, namespace: str) -> list[str]:
        validate_name(namespace, single=True, what="ref namespace")
        paths = self._glob(f"refs/{namespace}/*.json")
        return sorted(p.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json") for p in paths)

    # -- internals -----------------------------------------------------------------------------------------------
    @staticmethod
    def _ref_key(namespace: str, name: str) -> str:
        validate_name(namespace, single=True, what="ref namespace")
        return f"refs/{namespace}/{validate_name(name, single=True, what='ref name')}.json"

    @staticmethod
    def _doc_key(group: str, filename: str) -> str:
        validate_name(group, single=True, what="document group")
        validate_name(filename, single=True, what="document name")
        if not filename.endswith(".json") or filename == "manifest.json":
            raise InvalidName(f"invalid document name {filename!r}: use '<name>.json' other than manifest.json (only "
                              "write_manifest writes that)")
        return f"runs/{group}/{filename}"

    def _p(self, key: str) -> str:
        return f"{self._root}/{key}"

    def _scrub(self, exc: BaseException | str) -> str:
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _USERINFO_RE.sub(r"\1***@", text)[:500]

    def _parse(self, data: bytes, what: str) -> Any:
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError:
            raise StoreError(f"{what} in {self.url} is not UTF-8 JSON; restore it or rewrite it") from None

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One storage operation with bounded retries on transient errors; FileNotFoundError passes through."""
        start, delay, attempts = time.monotonic(), self._backoff_s, self._retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except (StoreError, FileNotFoundError):
                raise
            except _WRAPPED as exc:
                cause = f"{type(exc).__name__}: {self._scrub(exc)}"
                transient = isinstance(exc, _TRANSIENT_EXTRA) or (
                    isinstance(exc, OSError) and not isinstance(exc, _PERMANENT_OS))
                if not transient:
                    raise StoreError(f"{what} in store {self.url} failed ({cause}); check the storage options, "
                                     "credentials and permissions") from None
                if attempt == attempts:
                    raise StoreUnreachable(
                        f"store {self.url} unreachable: {what} failed {attempts} time(s) in "
                        f"{time.monotonic() - start:.1f}s (last: {cause}); check the endpoint and network, then "
                        "rerun (blobs already stored are kept and skipped)", url=self.url, cause=cause) from None
                log.warning("store %s: %s failed (attempt %d/%d, %s); retrying in %.2fs",
                            self.url, what, attempt, attempts, cause, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _size(self, key: str) -> int | None:
        try:
            return int(self._call(f"checking {key}", lambda: self._fs.info(self._p(key))["size"]))
        except FileNotFoundError:
            return None

    def _read(self, key: str) -> bytes | None:
        try:
            return self._call(f"reading {key}", lambda: self._fs.cat_file(self._p(key)))
        except FileNotFoundError:
            return None

    def _glob(self, pattern: str) -> list[str]:
        try:
            return list(self._call(f"listing {pattern}", lambda: self._fs.glob(self._p(pattern))))
        except FileNotFoundError:
            raise StoreError(f"store {self.url} does not exist (bucket or directory missing); check the URL") from None

    def _write(self, key: str, data: bytes) -> None:
        path, tmp = self._p(key), self._p(f"tmp/{uuid.uuid4().hex}.part")

        def write() -> None:
            if self._direct:  # one PUT: atomic per object (module docstring)
                self._fs.pipe_file(path, data)
            elif not self._local:
                self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                self._fs.pipe_file(tmp, data)
                self._fs.mv(tmp, path)
            else:
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())  # manifest-last means nothing if blob bytes are not on disk first
                    os.replace(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)

        try:
            self._call(f"writing {key}", write)
        except FileNotFoundError:
            raise StoreError(f"cannot write {key}: store {self.url} does not exist (bucket missing?); create "
                             "it first") from None

    def _hash_blob(self, sha256: str) -> str | None:
        """Streaming SHA-256 of a stored blob, or None when it is absent."""

        def digest() -> str:
            h = hashlib.sha256()
            with self._fs.open(self._p(blob_key(sha256)), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            return h.hexdigest()

        try:
            return self._call(f"hashing {blob_key(sha256)}", digest)
        except FileNotFoundError:
            return None

    def _check_blobs(self, run_id: str, tensors: dict[str, dict[str, Any]]) -> None:
        first: dict[str, tuple[str, int]] = {}
        for name, rec in tensors.items():
            first.setdefault(rec["sha256"], (name, rec["bytes"]))
        with ThreadPoolExecutor(1 if self._local else 8) as pool:  # on S3 each check is a HEAD round trip
            sizes = dict(zip(first, pool.map(lambda s: self._size(blob_key(s)), first), strict=True))
        for sha, (name, nbytes) in first.items():
            if sizes[sha] is None:
                raise BlobMissing(f"cannot write the manifest of run {run_id!r}: {_label(sha, name)} is missing from "
                                  f"{self.url}; store every tensor before the manifest", sha256=sha, name=name)
            if sizes[sha] != nbytes:
                if (actual := self._hash_blob(sha)) != sha:
                    raise _corrupt(self.url, sha, actual or "(vanished)", name)
                raise StoreError(f"manifest of run {run_id!r}: tensor {name!r} records {nbytes} bytes but its blob "
                                 f"has {sizes[sha]}; fix the record (use BlobRef.bytes)")

    def _manifest_bytes(self, run_id: str) -> bytes:
        key = f"runs/{validate_name(run_id, single=True, what='run id')}/manifest.json"
        if (data := self._read(key)) is None:
            raise ManifestMissing(f"run {run_id!r} has no manifest in {self.url}: it did not finish (an interrupted "
                                  "run leaves none) or the id is wrong; see list_runs(), or rerun it")
        return data


def _with_defaults(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """fsspec options with h3gate's defaults: for s3 short timeouts, one botocore attempt, no listings cache."""
    opts = dict(options)
    if protocol in ("s3", "s3a"):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # botocore's own retries off
        cfg.setdefault("connect_timeout", 3)
        cfg.setdefault("read_timeout", 30)
        opts["config_kwargs"] = cfg
        opts.setdefault("use_listings_cache", False)  # other processes add blobs and manifests at any time
        opts.setdefault("skip_instance_cache", True)  # we set fs.retries: never on a shared, cached instance
    return opts
