"""Shared pytest fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

# Before anything imports prefect or triton: an isolated Prefect home with telemetry off, and the
# Triton interpreter on CPU-only machines (kernels then run on CPU tensors).
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="h3gate-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real temporary Prefect API (SQLite) for flow tests: Prefect's own test harness."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3 endpoint (moto) on 127.0.0.1 for the session, with bucket `s3_server.bucket` created."""
    from tests.s3_server import S3Server  # moto is a dev extra: imported only by tests that use S3

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


@pytest.fixture(scope="module")
def calibrated_tiny(tmp_path_factory):
    """A tiny-preset reference (FP32, FP32-alt, the host's CPU providers) and its calibrated rule, via functions."""
    from tasks import calibration, model
    from tasks.providers import FP32_ALT_CPU, FP32_CPU, provider_set
    from tasks.reference import capture_reference_run, inventory, write_inventory
    from tasks.store import Store

    store = Store(str(tmp_path_factory.mktemp("calibrated") / "store"))
    preset = model.get_preset("tiny")
    checkpoint = model.write_synthetic_checkpoint(store, preset)
    sample_sha = model.write_sample(store, model.build_sample(preset.config, preset.sample))

    def run(provider, dtype):
        return capture_reference_run(store, preset, checkpoint, sample_sha, provider, dtype, "cpu")

    doc = inventory(preset, checkpoint, sample_sha, "cpu", "blocks", run(FP32_CPU, "float32"),
                    {name: run(p, "bfloat16") for name, p in provider_set("cpu").items()}, "cpu-default",
                    run(FP32_ALT_CPU, "float32"))
    reference = write_inventory(store, preset, doc)
    rule = calibration.write_rule(store, reference, calibration.provider_reports(store, reference))
    return store, preset, checkpoint, reference, rule
