"""The memory plan of one run: per device, what it will hold, checked before anything is allocated.

The numbers come from the model itself, not a formula kept beside it: the diffusers model is built on
the ``meta`` device (no memory), its parameters given the dtypes ``from_pretrained`` would give them
(``_keep_in_fp32_modules`` stay FP32), and the sample's forward is traced there under autograd's
saved-tensor hooks. Per device (a ``Placement`` says which modules are where):

- **weights**: parameter and buffer bytes of the modules placed there;
- **gradients**: capture streams each parameter gradient to the store and drops it, so at most one
  module's gradients are alive at once: the largest leaf module's parameter bytes;
- **activations**: the unique storages autograd saves for backward while the forward runs on that
  device (parameters excluded). Meta tensors always take SDPA's math path, so when the provider's
  attention is fused (every backend but ``_native_math``) the trace routes SDPA to the fused kernel's
  meta function, which saves q, k, v, output and log-sum-exp instead of S x S scores;
- **workspace**: three times the largest saved activation: at the peak of backward the gradient
  flowing into that activation, the gradient it produces and one temporary are alive beside it;
- **capture buffers**: the largest tensor captured there (the contiguous copy ``put_tensor`` makes
  before moving it to the host).

A device fits when the sum is within its capacity less a reserve (CUDA: the larger of 1 GiB and 5%,
for the context, library workspaces and allocator fragmentation; CPU: 10% of physical memory).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tasks.capture import DTYPES, Granularity, captured_modules
from tasks.model import GRAD_INPUTS, Preset, build_sample
from tasks.placement import BLOCKS, Placement
from tasks.providers import Provider

GiB = 1 << 30
WORKSPACE_FACTOR = 3


class PlanDoesNotFit(MemoryError):
    """The run would not fit on a device: the message names the device, the plan and the shortfall."""


@dataclass(frozen=True)
class DevicePlan:
    """What one device holds during the run, in bytes."""

    device: str
    blocks: int
    weights: int
    gradients: int
    activations: int
    workspace: int
    capture_buffers: int
    capacity: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.activations + self.workspace + self.capture_buffers

    @property
    def usable(self) -> int:
        return self.capacity - self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "usable": self.usable, "fits": self.fits}


@dataclass(frozen=True)
class MemoryPlan:
    """The per-device plan of one run (preset, dtype, sequence length, attention kind, placement)."""

    preset: str
    dtype: str
    seq_len: int
    fused_attention: bool
    placement: Placement
    devices: tuple[DevicePlan, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset, "dtype": self.dtype, "seq_len": self.seq_len,
            "attention": "fused" if self.fused_attention else "math", "placement": self.placement.to_json(),
            "devices": [d.to_json() for d in self.devices],
        }

    def table(self) -> str:
        """The plan as a fixed-width table, GiB per column."""
        head = f"{'device':<10} {'blocks':>6} {'weights':>8} {'grads':>7} {'activ':>7} {'work':>7} {'capture':>8} " \
               f"{'total':>8} {'usable':>8}  fits"
        rows = [head]
        for d in self.devices:
            cols = (d.weights, d.gradients, d.activations, d.workspace, d.capture_buffers, d.total)
            widths = (8, 7, 7, 7, 8, 8)
            cells = " ".join(f"{c / GiB:>{w}.2f}" for c, w in zip(cols, widths, strict=True))
            rows.append(f"{d.device:<10} {d.blocks:>6} {cells} {d.usable / GiB:>8.2f}  "
                        f"{'yes' if d.fits else 'NO'}")
        return "\n".join(rows)

    def require_fit(self) -> None:
        """Raise ``PlanDoesNotFit`` naming every device that would overflow."""
        over = [d for d in self.devices if not d.fits]
        if not over:
            return
        short = "; ".join(f"{d.device} needs {d.total / GiB:.1f} GiB of {d.usable / GiB:.1f} GiB usable "
                          f"(short by {(d.total - d.usable) / GiB:.1f} GiB)" for d in over)
        raise PlanDoesNotFit(
            f"preset {self.preset} in {self.dtype} at S={self.seq_len} does not fit: {short}. "
            f"Split it over more devices (--split / --gpus-per-run) or use a smaller preset.\n{self.table()}"
        )


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": GiB,
          "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"141GB"``, ``"80 GiB"`` or ``"1024"`` as bytes."""
    number = text.strip().lower().rstrip("bkmgti ")
    unit = text.strip().lower()[len(number):].strip() or "b"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"memory size {text!r}: give a positive number with a unit, e.g. 141GB or 80GiB")
    return int(value * _UNITS[unit])


def device_capacity(device: str) -> int:
    """The memory of a torch device in bytes (a GPU's total memory; the CPU's physical memory)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    if dev.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raise ValueError(f"no memory capacity known for device type {dev.type!r}")


def device_reserve(device: str, capacity: int) -> int:
    """The bytes kept free on a device of ``capacity`` bytes (see the module docstring)."""
    return max(GiB, capacity // 20) if torch.device(device).type == "cuda" else capacity // 10


def plan_memory(
    preset: Preset,
    dtype: str,
    placement: Placement,
    *,
    provider: Provider | None = None,
    granularity: Granularity = "blocks",
    capacities: Mapping[str, int] | None = None,
) -> MemoryPlan:
    """The plan of one run of ``preset`` in ``dtype`` placed as ``placement``.

    ``capacities`` (bytes per device) replaces the devices' own memory, to plan for a machine this
    is not (``h3gate plan --memory``); without it each device is asked.
    """
    if placement.num_layers != preset.config["num_layers"]:
        raise ValueError(f"placement holds {placement.num_layers} blocks; preset {preset.name} has "
                         f"{preset.config['num_layers']}")
    fused = provider is None or provider.attention_backend != "_native_math"
    on_cuda = torch.device(placement.main_device).type == "cuda"
    trace = trace_model(preset, DTYPES[dtype], placement, fused_attention=fused, fused_rms_norm=on_cuda,
                        granularity=granularity)
    plans = []
    for device in dict.fromkeys(placement.devices):
        entries = [i for i, d in enumerate(placement.devices) if d == device]
        capacity = capacities[device] if capacities is not None else device_capacity(device)
        plans.append(DevicePlan(
            device=device,
            blocks=sum(placement.block_counts[i] for i in entries),
            weights=sum(trace.weights[i] for i in entries),
            gradients=max(trace.largest_grad_set[i] for i in entries),
            activations=sum(trace.saved[i] for i in entries),
            workspace=WORKSPACE_FACTOR * max(trace.largest_saved[i] for i in entries),
            capture_buffers=max(trace.largest_captured[i] for i in entries),
            capacity=capacity,
            reserve=device_reserve(device, capacity),
        ))
    seq_len = int(trace.seq_len)
    return MemoryPlan(preset.name, dtype, seq_len, fused, placement, tuple(plans))


# ---------------------------------------------------------------------------------------------
# The meta-device trace
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelTrace:
    """Bytes per placement entry, measured on the meta device."""

    seq_len: int
    weights: list[int]
    largest_grad_set: list[int]
    saved: list[int]
    largest_saved: list[int]
    largest_captured: list[int]


def meta_model(preset: Preset, dtype: torch.dtype) -> torch.nn.Module:
    """The diffusers model on the meta device, parameters in the dtypes ``from_pretrained`` gives them."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config(dict(preset.config))
    keep = MiniMaxH3Transformer3DModel._keep_in_fp32_modules or []
    for name, param in model.named_parameters():
        kept = any(module in name.split(".") for module in keep)
        param.data = param.data.to(torch.float32 if kept or not param.is_floating_point() else dtype)
    return model.train(False)


def trace_model(
    preset: Preset, dtype: torch.dtype, placement: Placement, *, fused_attention: bool, fused_rms_norm: bool,
    granularity: Granularity,
) -> ModelTrace:
    """Run the sample's forward on the meta device, attributing saved and captured bytes to placement entries."""
    model = meta_model(preset, dtype)
    entries = len(placement.devices)
    trace = ModelTrace(0, [0] * entries, [0] * entries, [0] * entries, [0] * entries, [0] * entries)

    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        trace.weights[placement.entry_of(name)] += _nbytes(tensor)
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not any(True for _ in module.children()):
            entry = placement.entry_of(name)
            trace.largest_grad_set[entry] = max(trace.largest_grad_set[entry], sum(_nbytes(p) for p in own))

    owner = [0]
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in param_storages and key not in seen:
            seen.add(key)
            entry = owner[0]
            trace.saved[entry] += storage.nbytes()
            trace.largest_saved[entry] = max(trace.largest_saved[entry], storage.nbytes())
        return tensor

    def captured(entry: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                trace.largest_captured[entry] = max(trace.largest_captured[entry], _nbytes(output))
        return hook

    def enter(entry: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            owner[0] = entry
        return hook

    handles = []
    for name in captured_modules(model, granularity):
        handles.append(model.get_submodule(name).register_forward_hook(captured(placement.entry_of(name))))
    for index, block in enumerate(model.get_submodule(BLOCKS)):
        entry = placement.entry_of(f"{BLOCKS}.{index}")
        handles.append(block.register_forward_pre_hook(enter(entry)))
        handles.append(block.register_forward_hook(lambda *_: owner.__setitem__(0, 0)))
    for name, param in model.named_parameters():
        entry = placement.entry_of(name)
        trace.largest_captured[entry] = max(trace.largest_captured[entry], _nbytes(param))

    sample = build_sample(preset.config, preset.sample)
    inputs = {name: sample[name].to("meta") for name in sample if not name.startswith("grad_")}
    for name in GRAD_INPUTS:
        inputs[name].requires_grad_(True)
    trace.seq_len = int(inputs["position_ids"].shape[0])
    try:
        with _CudaKernelsOnMeta(fused_attention, fused_rms_norm), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(**inputs, return_dict=True)
        for tensor in (output.sample, output.audio_sample):
            trace.largest_captured[0] = max(trace.largest_captured[0], _nbytes(tensor))
    finally:
        for handle in handles:
            handle.remove()
    return trace


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


class _CudaKernelsOnMeta(TorchFunctionMode):
    """Makes the meta trace save what the device's kernels save, not what SDPA's and RMSNorm's decompositions do.

    Meta tensors take the decomposed path of both ops. With ``fused_attention``, SDPA goes to the
    memory-efficient kernel's meta function (saving q, k, v, out, lse). With ``fused_rms_norm`` (CUDA,
    where ``F.rms_norm`` runs one fused kernel that saves its input and the FP32 reciprocal RMS),
    RMSNorm saves exactly that, instead of the decomposition's three full-size intermediates.
    """

    def __init__(self, fused_attention: bool, fused_rms_norm: bool) -> None:
        super().__init__()
        self.fused_attention, self.fused_rms_norm = fused_attention, fused_rms_norm

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.fused_attention and func is torch.nn.functional.scaled_dot_product_attention:
            return _fused_sdpa(*args, **kwargs)
        if self.fused_rms_norm and func is torch.nn.functional.rms_norm:
            return _fused_rms_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's signature, answered by the memory-efficient kernel's meta function."""
    if enable_gqa:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


def _fused_rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm``'s signature; saves (input, weight, rstd) like the fused CUDA kernel."""
    return _SavesLikeFusedRMSNorm.apply(input, weight, len(tuple(normalized_shape)))


class _SavesLikeFusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        stat_dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
        rstd = input.new_empty((*input.shape[:-dims], *([1] * dims)), dtype=stat_dtype)
        ctx.save_for_backward(input, weight, rstd)
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError("the planning trace runs forward only")
