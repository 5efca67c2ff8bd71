"""Run one provider's work in a Python process of its own, for providers this process cannot run.

Some CPU providers choose ATen's kernels (``ATEN_CPU_CAPABILITY``), which torch reads once when it starts
(tasks/providers.py). Their work (a reference run, a generation trajectory) runs in a fresh interpreter started with
that environment: the request goes in on stdin as JSON (storage options included, so never on a command line or in
a log), the result comes back in a JSON file, and tensors through the store or a safetensors file, never pickle.
A failed child raises ``ProviderProcessError`` with the tail of its stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from tasks.providers import Provider, process_environment

_STDERR_TAIL = 4000


class ProviderProcessError(RuntimeError):
    """A provider's own process failed; the message names the provider and quotes the end of its stderr."""


def run_in_own_process(provider: Provider, entry: str, request: dict[str, Any]) -> dict[str, Any]:
    """Run ``entry`` (a name in ``ENTRIES``) on ``request`` in a fresh process set up for ``provider``; its JSON
    result, with the tensors of its ``tensor_file`` read (as ``tensors``)."""
    with tempfile.TemporaryDirectory(prefix="h3gate-provider-") as tmp:
        result_path = Path(tmp) / "result.json"
        doc = {"entry": entry, "provider": provider.to_json(), "request": request, "result": str(result_path),
               "scratch": tmp}
        env = {**os.environ, **process_environment(provider)}
        done = subprocess.run([sys.executable, "-m", "tasks.provider_process"], input=json.dumps(doc), text=True,
                              env=env, capture_output=True)
        if done.returncode != 0 or not result_path.exists():
            raise ProviderProcessError(f"provider {provider.name}: its own process ({entry}) exited with "
                                       f"{done.returncode}:\n{done.stderr[-_STDERR_TAIL:]}")
        result = json.loads(result_path.read_text())
        if "tensor_file" in result:  # a safetensors file in the scratch folder: read before the folder goes
            result["tensors"] = load_file(result.pop("tensor_file"))
        return result


def store_request(store: Any) -> dict[str, Any]:
    """What a child needs to open the same store."""
    return {"url": store.url, "storage_options": store.storage_options}


def _open_store(doc: dict[str, Any]) -> Any:
    from tasks.store import Store

    return Store(doc["url"], doc["storage_options"])


def _checkpoint(doc: dict[str, Any]) -> Any:
    from tasks.model import CheckpointRef

    return CheckpointRef(**doc)


def _capture(provider: Provider, request: dict[str, Any], scratch: str) -> dict[str, Any]:
    from tasks.model import Preset
    from tasks.reference import capture_reference_run

    info = capture_reference_run(_open_store(request["store"]), Preset.from_json(request["preset"]),
                                 _checkpoint(request["checkpoint"]), request["sample_sha"], provider,
                                 request["dtype"], request["device"], granularity=request["granularity"],
                                 force=request["force"])
    return dataclasses.asdict(info)


def _trajectory(provider: Provider, request: dict[str, Any], scratch: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from tasks.generate import provider_trajectory
    from tasks.model import Preset

    trajectory = provider_trajectory(_open_store(request["store"]), _checkpoint(request["checkpoint"]),
                                     Preset.from_json(request["preset"]), request["num_steps"], request["device"],
                                     provider)
    tensors = str(Path(scratch) / "trajectory.safetensors")
    save_file(trajectory.tensors, tensors)
    # safetensors keeps no order: the trajectory's (the comparison order) travels with it
    return {"tensor_file": tensors, "tensor_names": list(trajectory.tensors), "events": trajectory.events,
            "wall_s": trajectory.wall_s}


ENTRIES = {"capture": _capture, "trajectory": _trajectory}


def main() -> None:
    doc = json.loads(sys.stdin.read())
    provider = Provider(**doc["provider"])
    result = ENTRIES[doc["entry"]](provider, doc["request"], doc["scratch"])
    Path(doc["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
