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
