"""Providers: named, recorded configurations under which the reference model runs.

A provider fixes the diffusers attention backend, the BLAS library, the TF32 and reduced-precision
reduction flags, oneDNN, the thread count and (CPU) which of ATen's vectorized kernels run.
``activate(provider)`` applies it for the duration of a ``with`` block, restores every setting afterwards, and
yields what was *actually* in force (read back from torch, not copied from the request), so a run records
requested and actual side by side.

A provider that cannot run on this machine raises ``ProviderUnavailable`` with the reason; it is
never silently replaced by another.

CUDA set: ``default`` (native SDPA, cuBLAS), ``flash``, ``efficient``, ``cudnn``, ``math``
(the diffusers backends of the same names) and ``cublaslt`` (native SDPA on cuBLASLt).
CPU providers: ``cpu-default`` (native SDPA: the flash-CPU kernel) and ``cpu-math`` (math SDPA), each also with
oneDNN off (``cpu-no-onednn``, ``cpu-math-no-onednn``: ATen's own BF16 GEMMs) and on ATen's scalar kernels
(``cpu-scalar``, ``cpu-math-scalar``: ``ATEN_CPU_CAPABILITY=default``, which torch reads once at start, so these run
in a process of their own: tasks/provider_process.py); ``cpu-1thread`` (one thread) runs by name only. The default
CPU set depends on the host (``provider_set``): where oneDNN runs the BF16 GEMMs (AVX-512 and later) it is the four
oneDNN on/off providers; elsewhere oneDNN off changes nothing (those would be twins, tasks/rules.py) and the scalar
kernels take their place.
The FP32 reference runs under ``fp32`` (native SDPA, TF32 off, highest matmul precision); ``fp32-alt``
(math SDPA, another GEMM library) measures the FP32 reference's own rounding noise for the floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# oneDNN picks its BF16 GEMM kernels by the best ISA of the host: Intel AMX kernels (Sapphire Rapids and later)
# round differently from AVX-512 BF16 ones, so a CPU reference, its provider spread and the calibrated k would
# depend on which host made them (measured on the tiny preset: k 1.375 without AMX, 1.077 with it, and the honest
# candidate then over its bound on two norm-weight gradients). CPU references cap oneDNN at AVX-512 BF16, the
# same kernels on both kinds of host; an ONEDNN_MAX_CPU_ISA the user sets wins. oneDNN reads it lazily, at its
# first primitive, so setting it at import (before any run) is in time.
CPU_ONEDNN_MAX_ISA = "AVX512_CORE_BF16"
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", CPU_ONEDNN_MAX_ISA)


class ProviderUnavailable(RuntimeError):
    """A provider cannot run here; the message names it and says why."""


@dataclass(frozen=True)
class Provider:
    """One provider configuration (what is requested)."""

    name: str
    device_type: str  # "cuda" or "cpu"
    attention_backend: str = "native"
    blas: str | None = None  # torch.backends.cuda.preferred_blas_library: "cublas" | "cublaslt"
    allow_tf32: bool = False
    reduced_precision_reduction: bool = True  # torch's default for BF16 GEMMs on CUDA
    onednn: bool = True
    threads: int | None = None
    aten_capability: str | None = None  # ATEN_CPU_CAPABILITY of the process it runs in ("default": scalar kernels)
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        """The provider as recorded (part of a run's identity); ``aten_capability`` only where set, so the runs of
        providers older than the field keep their ids."""
        doc = dataclasses.asdict(self)
        if doc["aten_capability"] is None:
            del doc["aten_capability"]
        return doc


FP32_CUDA = Provider("fp32", "cuda", description="FP32 reference: native SDPA, TF32 off")
FP32_CPU = Provider("fp32", "cpu", description="FP32 reference: native SDPA")
# A second FP32 run that differs from the reference only in rounding (another attention kernel and
# GEMM library): its per-tensor error is the FP32 reference's own noise, from which the floor comes.
# On CUDA the math SDPA would materialize S x S scores per head in FP32 (56 GiB at S=16384, measured OOM on the
# H200 with the block preset): the memory-efficient kernel (FP32-capable) is the other attention path there.
FP32_ALT_CUDA = Provider("fp32-alt", "cuda", "_native_efficient", "cublaslt",
                         description="FP32 noise run: memory-efficient SDPA, cuBLASLt")
FP32_ALT_CPU = Provider("fp32-alt", "cpu", "_native_math", onednn=False, description="FP32 noise run: math SDPA")

CUDA_PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("default", "cuda", blas="cublas", description="native SDPA (torch picks the kernel), cuBLAS"),
        Provider("flash", "cuda", "_native_flash", "cublas", description="SDPA flash-attention kernel"),
        Provider("efficient", "cuda", "_native_efficient", "cublas", description="SDPA memory-efficient kernel"),
        Provider("cudnn", "cuda", "_native_cudnn", "cublas", description="SDPA cuDNN kernel"),
        Provider("math", "cuda", "_native_math", "cublas", description="SDPA math (unfused) attention"),
        Provider("cublaslt", "cuda", "native", "cublaslt", description="native SDPA, GEMMs on cuBLASLt"),
    )
}
CPU_PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("cpu-default", "cpu", description="native SDPA (flash-CPU kernel), oneDNN GEMMs"),
        Provider("cpu-math", "cpu", "_native_math", description="math SDPA, oneDNN GEMMs"),
        Provider("cpu-no-onednn", "cpu", onednn=False, description="native SDPA, ATen GEMMs (oneDNN off)"),
        Provider("cpu-math-no-onednn", "cpu", "_native_math", onednn=False, description="math SDPA, ATen GEMMs"),
        Provider("cpu-scalar", "cpu", aten_capability="default", description="native SDPA, ATen's scalar kernels"),
        Provider("cpu-math-scalar", "cpu", "_native_math", aten_capability="default",
                 description="math SDPA, ATen's scalar kernels"),
        # Thread count is a provider knob too, but on the tiny preset one thread was byte-identical to the default
        # on 103 of 104 tensors with oneDNN BF16 GEMMs and on all 104 without: it runs by name only.
        Provider("cpu-1thread", "cpu", threads=1, description="native SDPA, one thread"),
    )
}
# The default CPU set of each kind of host (tasks/rules.py twins: providers identical on every tensor count once).
CPU_SET_WITH_ONEDNN_GEMMS = ("cpu-default", "cpu-math", "cpu-no-onednn", "cpu-math-no-onednn")
CPU_SET_WITH_ATEN_GEMMS = ("cpu-default", "cpu-math", "cpu-scalar", "cpu-math-scalar")
# The provider whose error defines the single-provider bound (kept as a record).
DEFAULT_PROVIDER = {"cuda": "default", "cpu": "cpu-default"}


def device_type_of(device: str | torch.device) -> str:
    return torch.device(device).type


def provider_set(device: str | torch.device) -> dict[str, Provider]:
    """The providers a reference runs by default on ``device`` (on a CPU, this host's set: the module docstring)."""
    if device_type_of(device) == "cuda":
        return CUDA_PROVIDERS
    names = CPU_SET_WITH_ONEDNN_GEMMS if host_runs_onednn_bf16_gemms() else CPU_SET_WITH_ATEN_GEMMS
    return {name: CPU_PROVIDERS[name] for name in names}


def named_providers(device: str | torch.device) -> dict[str, Provider]:
    """Every BF16 provider of ``device``'s type that can be asked for by name."""
    return CUDA_PROVIDERS if device_type_of(device) == "cuda" else CPU_PROVIDERS


def needs_own_process(provider: Provider) -> bool:
    """Whether ``provider`` asks for ATen kernels other than this process's (fixed when torch started)."""
    wanted = provider.aten_capability
    return wanted is not None and wanted.lower() != torch.backends.cpu.get_cpu_capability().lower()


def process_environment(provider: Provider) -> dict[str, str]:
    """The environment variables a process needs, set before torch starts, for ``provider`` to run in it."""
    return {"ATEN_CPU_CAPABILITY": provider.aten_capability} if provider.aten_capability else {}


def fp32_provider(device: str | torch.device) -> Provider:
    return FP32_CUDA if device_type_of(device) == "cuda" else FP32_CPU


def fp32_alt_provider(device: str | torch.device) -> Provider:
    return FP32_ALT_CUDA if device_type_of(device) == "cuda" else FP32_ALT_CPU


def resolve_provider(name: str, device: str | torch.device) -> Provider:
    """Any provider by name: ``fp32``, ``fp32-alt`` or one of the device's BF16 providers."""
    if name == "fp32":
        return fp32_provider(device)
    if name == "fp32-alt":
        return fp32_alt_provider(device)
    return resolve_providers([name], device)[0]


def resolve_providers(names: list[str] | None, device: str | torch.device) -> list[Provider]:
    """The requested providers for ``device`` (all of its set when ``names`` is empty)."""
    if not names:
        return list(provider_set(device).values())
    available = named_providers(device)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ProviderUnavailable(
            f"unknown provider(s) {', '.join(unknown)} for device type {device_type_of(device)}; "
            f"choose from {', '.join(available)}"
        )
    return [available[n] for n in names]


def check_available(provider: Provider, device: str | torch.device) -> None:
    """Raise ``ProviderUnavailable`` (with the reason) if ``provider`` cannot run on ``device``."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    kind = device_type_of(device)
    if provider.device_type != kind:
        raise ProviderUnavailable(f"provider {provider.name} is a {provider.device_type} provider; device is {kind}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ProviderUnavailable(f"provider {provider.name} needs CUDA, which is not available")
    if provider.attention_backend not in _AttentionBackendRegistry._backends:
        raise ProviderUnavailable(
            f"provider {provider.name}: diffusers has no attention backend {provider.attention_backend}"
        )
    if provider.blas == "cublaslt" and torch.version.hip:
        raise ProviderUnavailable(f"provider {provider.name}: cuBLASLt selection is CUDA-only")
    if needs_own_process(provider):
        raise ProviderUnavailable(
            f"provider {provider.name} needs ATEN_CPU_CAPABILITY={provider.aten_capability} before torch starts "
            f"(this process runs {torch.backends.cpu.get_cpu_capability()}): references and generation runs start "
            "a process of their own for it (tasks/provider_process.py); a diagnose variant cannot"
        )


@contextlib.contextmanager
def activate(provider: Provider, device: str | torch.device) -> Iterator[dict[str, Any]]:
    """Apply ``provider`` for the block; yield the actual configuration; restore everything after."""
    from diffusers.models.attention_dispatch import attention_backend

    check_available(provider, device)
    saved = _snapshot()
    try:
        torch.backends.mkldnn.enabled = provider.onednn
        if provider.threads is not None:
            torch.set_num_threads(provider.threads)
        torch.backends.cuda.matmul.allow_tf32 = provider.allow_tf32
        torch.backends.cudnn.allow_tf32 = provider.allow_tf32
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = provider.reduced_precision_reduction
        torch.set_float32_matmul_precision("high" if provider.allow_tf32 else "highest")
        if provider.blas is not None and device_type_of(device) == "cuda":
            torch.backends.cuda.preferred_blas_library(provider.blas)
        with attention_backend(provider.attention_backend):
            yield actual_configuration(provider, device)
    finally:
        _restore(saved)


def _snapshot() -> dict[str, Any]:
    state = {
        "onednn": torch.backends.mkldnn.enabled,
        "threads": torch.get_num_threads(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "bf16_rpr": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "fp32_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        state["blas"] = torch.backends.cuda.preferred_blas_library()
    return state


def _restore(state: dict[str, Any]) -> None:
    torch.backends.mkldnn.enabled = state["onednn"]
    torch.set_num_threads(state["threads"])
    torch.backends.cuda.matmul.allow_tf32 = state["tf32_matmul"]
    torch.backends.cudnn.allow_tf32 = state["tf32_cudnn"]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = state["bf16_rpr"]
    torch.set_float32_matmul_precision(state["fp32_precision"])
    if "blas" in state:
        torch.backends.cuda.preferred_blas_library(state["blas"])


def host_runs_onednn_bf16_gemms() -> bool:
    """Whether torch sends BF16 GEMMs to oneDNN on this host (AVX-512 and later). Elsewhere torch runs them in ATen
    whatever oneDNN's flag says, so the "oneDNN off" providers are twins of their oneDNN ones (tasks/rules.py)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def actual_configuration(provider: Provider, device: str | torch.device) -> dict[str, Any]:
    """What is in force right now, read back from torch and diffusers."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    actual: dict[str, Any] = {
        "attention_backend": str(_AttentionBackendRegistry.get_active_backend()[0].value),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "onednn_bf16_gemm": bool(torch.backends.mkldnn.enabled and host_runs_onednn_bf16_gemms()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "reduced_precision_reduction": bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device_type_of(device) == "cuda":
        actual["blas"] = str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower()
        actual["cudnn_version"] = torch.backends.cudnn.version()
    return actual


def library_versions() -> dict[str, Any]:
    """Versions that decide the numbers of a run (recorded in run metadata)."""
    import diffusers

    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:  # triton is optional on CPU-only installs of torch
        versions["triton"] = None
    from importlib.metadata import PackageNotFoundError, version

    try:
        versions["h3gate"] = version("h3gate")
    except PackageNotFoundError:
        versions["h3gate"] = "source"
    return versions


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()
