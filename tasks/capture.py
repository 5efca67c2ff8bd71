"""One forward + backward of the model that captures every tensor in real execution order.

Names (DESIGN 4): ``out/<field>`` model outputs, ``dinput/<arg>`` input gradients,
``grad/<param>`` parameter gradients, ``fwd/<module>`` module outputs, ``bwd/<module>`` the
gradient w.r.t. a module's first input, and ``in/<module>/<arg>`` the inputs of the golden block
(block 0) in reference runs, so golden tests can replay them.

Order: a single counter across the whole run. Forward hooks fire in forward order; ``out/*`` follow
the forward; then full backward hooks, parameter post-accumulate-grad hooks and input-gradient
hooks fire in the order autograd runs them. First drift is defined on this order.

Granularity: ``blocks`` captures the boundary modules, every refiner block and every transformer
block; ``nodes`` adds every submodule inside those blocks. Modules whose output is not a single
tensor (the AdaLN modulation's 6-tuple, rope's (cos, sin)) have no ``fwd/`` entry; their internal
``linear`` has one at node granularity.

Streaming: every tensor goes to ``sink(name, kind, order, tensor)`` the moment it exists, and a
parameter's ``.grad`` is dropped right after its hook has handed it on, so a run never holds two
copies of the model's gradients.
"""

from __future__ import annotations

import datetime
import getpass
import hashlib
import json
import socket
import subprocess
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tasks.model import GRAD_INPUTS, UPSTREAM_GRADS, model_inputs
from tasks.providers import Provider, activate, device_name, library_versions
from tasks.store import Store, validate_name

Granularity = Literal["blocks", "nodes"]
Sink = Callable[[str, str, int, torch.Tensor], None]

BOUNDARY_MODULES = (
    "proj_in",
    "audio_proj_in",
    "context_embedder",
    "time_embedder",
    "token_refiner",
    "norm_out",
    "proj_out",
    "audio_proj_out",
)
BLOCK_LISTS = ("transformer_blocks", "token_refiner.refiner_blocks")
# Identity modules (dropout p=0) add nothing but a duplicate of their input.
_SKIPPED_TYPES = (torch.nn.Dropout,)
GOLDEN_BLOCK = "transformer_blocks.0"
GOLDEN_ARGS = ("hidden_states", "temb", "adaln_indices", "rotary_cos", "rotary_sin")


@dataclass
class CaptureResult:
    """What a capture run produced: names in execution order, with their kind."""

    entries: list[tuple[str, str, int]] = field(default_factory=list)  # (name, kind, order)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]


def captured_modules(model: torch.nn.Module, granularity: Granularity) -> list[str]:
    """Module names captured at ``granularity`` (in definition order; capture order is execution order)."""
    if granularity not in ("blocks", "nodes"):
        raise ValueError(f"capture granularity must be 'blocks' or 'nodes', got {granularity!r}")
    names: list[str] = [n for n in BOUNDARY_MODULES if _has_module(model, n)]
    for list_name in BLOCK_LISTS:
        blocks = model.get_submodule(list_name)
        for index, block in enumerate(blocks):
            prefix = f"{list_name}.{index}"
            names.append(prefix)
            if granularity == "nodes":
                names += [
                    f"{prefix}.{sub}"
                    for sub, module in block.named_modules()
                    if sub and not isinstance(module, _SKIPPED_TYPES)
                ]
    return names


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


class _Recorder:
    """Hands tensors to the sink with a shared execution-order counter."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.result = CaptureResult()

    def __call__(self, name: str, kind: str, tensor: torch.Tensor) -> None:
        order = len(self.result.entries)
        self.result.entries.append((name, kind, order))
        self.sink(name, kind, order, tensor.detach())


def run_capture(
    model: torch.nn.Module,
    sample: Mapping[str, torch.Tensor],
    sink: Sink,
    *,
    device: str | torch.device,
    granularity: Granularity = "blocks",
    golden_inputs: bool = False,
) -> CaptureResult:
    """Run forward + backward with the sample's seeded upstream gradients, sending every tensor to ``sink``.

    ``golden_inputs`` also captures the inputs of block 0 (``in/transformer_blocks.0/<arg>``).
    """
    recorder = _Recorder(sink)
    handles: list[Any] = []
    seen_grads: set[str] = set()
    try:
        for name in captured_modules(model, granularity):
            module = model.get_submodule(name)
            handles.append(module.register_forward_hook(_forward_hook(recorder, name)))
            handles.append(module.register_full_backward_hook(_backward_hook(recorder, name)))
        if golden_inputs:
            handles.append(model.get_submodule(GOLDEN_BLOCK).register_forward_pre_hook(_golden_hook(recorder)))
        for pname, param in model.named_parameters():
            if param.requires_grad:
                handles.append(param.register_post_accumulate_grad_hook(_grad_hook(recorder, pname, seen_grads)))

        inputs = model_inputs(sample, device)
        for arg in GRAD_INPUTS:
            handles.append(inputs[arg].register_post_accumulate_grad_hook(_input_grad_hook(recorder, arg)))
        forward_backward(model, inputs, sample, on_output=lambda field, t: recorder(f"out/{field}", "out", t))
    finally:
        for handle in handles:
            handle.remove()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in seen_grads]
    if missing:
        raise RuntimeError(f"backward produced no gradient for {len(missing)} parameters, e.g. {missing[:3]}")
    return recorder.result


def forward_backward(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    sample: Mapping[str, torch.Tensor],
    *,
    on_output: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """One forward, then one backward from the sample's seeded upstream gradients (``on_output`` sees each output)."""
    with warnings.catch_warnings():
        # time_embedder's input (the sinusoidal timestep features) needs no gradient; torch warns that
        # its full backward hook then sees output gradients only, which is what we want there.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        output = model(**inputs, return_dict=True)
        outputs, grads = [], []
        for field_name, grad_name in UPSTREAM_GRADS.items():
            tensor = getattr(output, field_name)
            if on_output is not None:
                on_output(field_name, tensor)
            outputs.append(tensor)
            grads.append(sample[grad_name].to(device=tensor.device, dtype=tensor.dtype))
        del output
        torch.autograd.backward(outputs, grads)


def _forward_hook(recorder: _Recorder, name: str) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            recorder(f"fwd/{name}", "fwd", output)

    return hook


def _backward_hook(recorder: _Recorder, name: str) -> Callable[..., None]:
    def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        if grad_input and isinstance(grad_input[0], torch.Tensor):
            recorder(f"bwd/{name}", "bwd", grad_input[0])

    return hook


def _grad_hook(recorder: _Recorder, name: str, seen: set[str]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        seen.add(name)
        recorder(f"grad/{name}", "grad", param.grad)
        param.grad = None  # streamed: the sink has it now

    return hook


def _input_grad_hook(recorder: _Recorder, arg: str) -> Callable[[torch.Tensor], None]:
    def hook(tensor: torch.Tensor) -> None:
        recorder(f"dinput/{arg}", "dinput", tensor.grad)

    return hook


def _golden_hook(recorder: _Recorder) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        hidden_states, temb, adaln_indices, (cos, sin) = args[:4]
        for arg, tensor in zip(GOLDEN_ARGS, (hidden_states, temb, adaln_indices, cos, sin), strict=True):
            recorder(f"in/{GOLDEN_BLOCK}/{arg}", "in", tensor)

    return hook


# ---------------------------------------------------------------------------------------------
# A recorded run: capture into the store, manifest last
# ---------------------------------------------------------------------------------------------

CAPTURE_FORMAT = 1  # bumped when names, order or the sample protocol change (part of run identity)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunSpec:
    """Everything that decides the content of a run (its identity)."""

    preset: str
    config: Mapping[str, Any]
    checkpoint_sha: str
    sample_sha: str
    provider: Mapping[str, Any]
    dtype: str
    device_type: str
    granularity: Granularity = "blocks"
    golden_inputs: bool = False
    candidate: Mapping[str, Any] | None = None  # the candidate binding (nodes, kernel versions) if any

    def identity(self) -> dict[str, Any]:
        return {
            "format": CAPTURE_FORMAT,
            "preset": self.preset,
            "config": json.loads(json.dumps(dict(self.config), sort_keys=True, default=list)),
            "checkpoint": self.checkpoint_sha,
            "sample": self.sample_sha,
            "provider": dict(self.provider),
            "dtype": self.dtype,
            "device_type": self.device_type,
            "granularity": self.granularity,
            "golden_inputs": self.golden_inputs,
            "candidate": dict(self.candidate) if self.candidate else None,
        }

    @property
    def run_id(self) -> str:
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        role = "cand" if self.candidate else "ref"
        return f"{self.preset}-{role}-{self.provider['name']}-{self.dtype}-{digest[:12]}"


@dataclass(frozen=True)
class RunInfo:
    """A small record of a stored run (what tasks exchange)."""

    run_id: str
    manifest_sha: str
    tensors: int
    stored_bytes: int
    new_bytes: int  # tensor bytes this run added to the store (0 when every blob was already there)
    reused: bool
    wall_s: float
    peak_device_bytes: int | None


class StoreSink:
    """Writes each captured tensor to the store as it arrives and keeps the manifest records."""

    def __init__(self, store: Store, progress: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.records: dict[str, dict[str, Any]] = {}
        self.new_bytes = 0
        self.progress = progress

    def __call__(self, name: str, kind: str, order: int, tensor: torch.Tensor) -> None:
        validate_name(name)
        ref, dtype, shape = self.store.put_tensor(tensor)  # skips blobs already present (resume, dedupe)
        self.records[name] = {
            "sha256": ref.sha256,
            "bytes": ref.bytes,
            "dtype": dtype,
            "shape": shape,
            "order": order,
            "kind": kind,
        }
        if self.progress is not None:
            self.progress(len(self.records))


def stored_run(store: Store, run_id: str) -> RunInfo | None:
    """The ``RunInfo`` of a run the store already holds (its manifest exists), else None."""
    if not store.has_manifest(run_id):
        return None
    manifest = store.read_manifest(run_id)
    tensors = manifest["tensors"]
    stored = sum(r["bytes"] for r in tensors.values())
    meta = manifest.get("metadata", {})
    return RunInfo(run_id, store.manifest_sha(run_id), len(tensors), stored, 0, True,
                   meta.get("wall_s", 0.0), meta.get("peak_device_bytes"))


def expected_tensor_count(model: torch.nn.Module, granularity: Granularity, golden_inputs: bool) -> int:
    """An upper bound on the number of tensors a capture of ``model`` produces (for progress bars)."""
    params = sum(1 for p in model.parameters() if p.requires_grad)
    modules = len(captured_modules(model, granularity))
    return params + 2 * modules + len(UPSTREAM_GRADS) + len(GRAD_INPUTS) + (len(GOLDEN_ARGS) if golden_inputs else 0)


def record_run(
    store: Store,
    spec: RunSpec,
    model: torch.nn.Module,
    sample: Mapping[str, torch.Tensor],
    provider: Provider,
    *,
    device: str | torch.device,
    progress: Callable[[int, int], None] | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    model_devices: Sequence[str] = (),
) -> RunInfo:
    """Capture one run of ``model`` (already in ``spec.dtype``) into the store; the manifest is written last.

    An interrupted run left no manifest, so rerunning it re-captures and skips the blobs it had
    already written. ``overwrite`` replaces an existing manifest (a forced regeneration). Peak memory
    is measured on ``device`` and on every CUDA device in ``model_devices`` (a split model).
    """
    run_id = spec.run_id
    expected = expected_tensor_count(model, spec.granularity, spec.golden_inputs)
    sink = StoreSink(store, progress=(lambda done: progress(done, expected)) if progress else None)
    bytes_before = store.bytes_written
    started = time.perf_counter()
    with activate(provider, device) as actual, PeakMemory((device, *model_devices)) as memory:
        run_capture(model, sample, sink, device=device, granularity=spec.granularity, golden_inputs=spec.golden_inputs)
    wall_s = time.perf_counter() - started
    new_tensor_bytes = store.bytes_written - bytes_before  # before the manifest: tensor blobs only
    manifest = {
        "run_id": run_id,
        "tensors": sink.records,
        "identity": spec.identity(),
        "metadata": {
            **run_environment(device),
            "provider_requested": provider.to_json(),
            "provider_actual": actual,
            "wall_s": round(wall_s, 3),
            "peak_device_bytes": memory.peak,
            "peak_device_bytes_by_device": memory.by_device,
            **dict(metadata or {}),
        },
    }
    manifest_ref = store.write_manifest(run_id, manifest, overwrite=overwrite)
    stored = sum(r["bytes"] for r in sink.records.values())
    return RunInfo(run_id, manifest_ref.sha256, len(sink.records), stored, new_tensor_bytes, False, wall_s,
                   memory.peak)


class PeakMemory:
    """Peak allocated bytes on each CUDA device among ``devices`` over a ``with`` block (synchronized at exit)."""

    def __init__(self, devices: Sequence[str | torch.device]) -> None:
        self.devices = sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str)
        self.by_device: dict[str, int] = {}

    def __enter__(self) -> PeakMemory:
        for device in self.devices:
            torch.cuda.reset_peak_memory_stats(device)
        return self

    def __exit__(self, *exc: Any) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device)
        self.by_device = {str(d): torch.cuda.max_memory_allocated(d) for d in self.devices}

    @property
    def peak(self) -> int | None:
        """The largest per-device peak (None on the CPU)."""
        return max(self.by_device.values()) if self.by_device else None


def run_environment(device: str | torch.device) -> dict[str, Any]:
    """Run metadata outside content identity: versions, device, time, host, user, git commit."""
    return {
        "versions": library_versions(),
        "device": str(device),
        "device_name": device_name(device),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "user": getpass.getuser(),
        "git_commit": git_commit(),
    }


def git_commit() -> str | None:
    """The h3gate source commit, when running from a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
