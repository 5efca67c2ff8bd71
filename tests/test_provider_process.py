"""Providers that fix ATen's CPU kernels run their work in a process of their own (tasks/provider_process.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tasks import generate as gen
from tasks.provider_process import ProviderProcessError, run_in_own_process
from tasks.providers import CPU_PROVIDERS, ProviderUnavailable, activate, needs_own_process
from tasks.reference import capture_reference_run

SCALAR = CPU_PROVIDERS["cpu-scalar"]
pytestmark = pytest.mark.skipif(not needs_own_process(SCALAR), reason="this process already runs ATen's scalar kernels")


def test_a_scalar_provider_cannot_run_in_this_process():
    with pytest.raises(ProviderUnavailable, match="ATEN_CPU_CAPABILITY=default before torch starts"):
        with activate(SCALAR, "cpu"):
            pass


def test_a_scalar_reference_run_is_made_in_its_own_process_and_recorded(store, tiny, tiny_checkpoint,
                                                                         tiny_sample_sha):
    run = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, SCALAR, "bfloat16", "cpu")
    manifest = store.read_manifest(run.run_id)
    assert not run.reused and store.verify_run(run.run_id).ok
    assert manifest["metadata"]["provider_actual"]["cpu_capability"] == "DEFAULT"
    assert manifest["metadata"]["provider_requested"]["aten_capability"] == "default"
    again = capture_reference_run(store, tiny, tiny_checkpoint, tiny_sample_sha, SCALAR, "bfloat16", "cpu")
    assert again.reused and again.run_id == run.run_id  # found in the store: no process started


def test_a_scalar_trajectory_comes_back_whole(store, tiny, tiny_checkpoint):
    own = gen._trajectory_in_own_process(store, tiny_checkpoint, tiny, 3, "cpu", SCALAR)
    here_provider = dataclasses.replace(SCALAR, aten_capability=None)
    here = gen.provider_trajectory(store, tiny_checkpoint, tiny, 3, "cpu", here_provider)
    assert list(own.tensors) == list(here.tensors) and [e[:2] for e in own.events] == [e[:2] for e in here.events]
    assert all(t.dtype == torch.float32 for t in own.tensors.values())
    differs = [n for n in own.tensors if not torch.equal(own.tensors[n], here.tensors[n])]
    assert differs, "the scalar kernels computed exactly what this process's kernels did"


def test_a_failing_child_names_the_provider_and_quotes_its_error(store):
    with pytest.raises(ProviderProcessError, match=r"(?s)provider cpu-scalar: its own process \(capture\).*KeyError"):
        run_in_own_process(SCALAR, "capture", {"store": {"url": store.url, "storage_options": {}}})
