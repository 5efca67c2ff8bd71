"""tasks/prefetch.py: verified tensors read ahead on threads, in order, within a byte window (local and S3)."""

from __future__ import annotations

import hashlib
import threading
import uuid

import pytest
import torch

from tasks.prefetch import TensorPrefetcher
from tasks.store import BlobCorrupt, Store, blob_key


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_server")
    return Store(f"s3://{server.bucket}/{uuid.uuid4().hex}", server.options())


class _WatchedStore(Store):
    """The same store, recording which keys were being read at once (instrumentation: every read is real)."""

    def __init__(self, url: str, options=None) -> None:
        super().__init__(url, options)
        self.lock = threading.Lock()
        self.started: list[str] = []

    def get_tensor(self, sha256, *, name=None, device="cpu"):
        with self.lock:
            self.started.append(name)
        return super().get_tensor(sha256, name=name, device=device)


def _items(store: Store, n: int) -> tuple[list[tuple[str, str, int]], dict[str, torch.Tensor]]:
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(n)}
    items = []
    for key, t in tensors.items():
        ref, _, _ = store.put_tensor(t, name=key)
        items.append((key, ref.sha256, ref.bytes))
    return items, tensors


def test_every_tensor_comes_back_verified_in_any_order(store):
    items, tensors = _items(store, 12)
    with TensorPrefetcher(store, items, workers=4, window_bytes=3 * items[0][2]) as pre:
        assert torch.equal(pre.get("t7"), tensors["t7"])  # out of order: read at once
        for key in [k for k, _, _ in items if k != "t7"]:
            assert torch.equal(pre.get(key), tensors[key])
        with pytest.raises(KeyError, match="t3"):
            pre.get("t3")  # each key is handed out once


def test_reads_stay_within_the_window(tmp_path):
    plain = Store(str(tmp_path / "store"))
    items, _ = _items(plain, 10)
    store = _WatchedStore(plain.url)
    one = items[0][2]
    with TensorPrefetcher(store, items, workers=8, window_bytes=2 * one) as pre:
        assert set(store.started) <= {"t0", "t1"}  # submitted from this thread only: an upper bound, not a race
        pre.get("t0")
        assert set(store.started) <= {"t0", "t1", "t2"}
        for key in [f"t{i}" for i in range(1, 10)]:
            pre.get(key)
    assert sorted(store.started) == sorted(k for k, _, _ in items)
    # a window smaller than one tensor still reads one at a time
    store.started.clear()
    with TensorPrefetcher(store, items, window_bytes=1) as pre:
        assert len(store.started) <= 1
        pre.get("t0")


def test_a_corrupt_blob_is_raised_by_the_get_of_its_key(store):
    items, tensors = _items(store, 4)
    key, sha, _ = items[2]
    store.fs.pipe_file(f"{store.root}/{blob_key(sha)}", b"tampered bytes")
    with TensorPrefetcher(store, items) as pre:
        assert torch.equal(pre.get("t0"), tensors["t0"]) and torch.equal(pre.get("t1"), tensors["t1"])
        with pytest.raises(BlobCorrupt) as err:
            pre.get("t2")
        assert err.value.name == "t2" and err.value.actual == hashlib.sha256(b"tampered bytes").hexdigest()
        assert torch.equal(pre.get("t3"), tensors["t3"])


def test_duplicate_keys_are_refused(tmp_path):
    store = Store(str(tmp_path / "store"))
    items, _ = _items(store, 2)
    with pytest.raises(ValueError, match="unique"):
        TensorPrefetcher(store, [items[0], items[0]])
