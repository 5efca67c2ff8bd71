"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 endpoint (moto) on 127.0.0.1 for the session, with bucket `s3_server.bucket` created."""
    server = S3Server().start()
    server.create_bucket()
    yield server
    server.stop()


# ---------------------------------------------------------------------------------------------
# The tiny preset: a store, its synthetic checkpoint, its sample and an FP32 model (module-scoped
# where building them costs time; every test that mutates one takes its own).
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    from tasks.store import Store

    return Store(str(tmp_path / "store"))


@pytest.fixture(scope="session")
def tiny():
    from tasks.model import get_preset

    return get_preset("tiny")


@pytest.fixture
def tiny_checkpoint(store, tiny):
    from tasks.model import write_synthetic_checkpoint

    return write_synthetic_checkpoint(store, tiny)


@pytest.fixture
def tiny_sample(tiny):
    from tasks.model import build_sample

    return build_sample(tiny.config, tiny.sample)


@pytest.fixture
def tiny_sample_sha(store, tiny_sample):
    from tasks.model import write_sample

    return write_sample(store, tiny_sample)


@pytest.fixture
def tiny_model(store, tiny_checkpoint):
    import torch

    from tasks.model import load_model

    return load_model(store, tiny_checkpoint, torch.float32, "cpu")
