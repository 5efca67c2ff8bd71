"""Shared plumbing of the h3kernels ops: input validation, output allocation, rounding, block sizes.

Contract:
- `KernelInputError(ValueError)` is the one error every op raises for bad inputs; its message names the op,
  the argument and the problem (empty, non-contiguous, mixed devices, wrong dtype, wrong shape, index out of
  range), so that the binding can report a strict-mode fallback with its reason.
- `check_inputs(op, *tensors, dtypes=..., device=...)` validates tensors given bare or as `(name, tensor)` pairs
  and returns their common device.
- `check_index(...)` range-checks an index tensor with one device sync per tensor and in-place change, not per call
  (its minimum and maximum are remembered against the tensor's version counter).
- `new_empty(shape, dtype, device)` is how every launcher allocates a buffer that its kernel must fully write.
  Inside `poisoned_outputs()` those buffers are NaN-filled (floats) or max-filled (ints), so tests prove that
  every element is written without monkeypatching.
- `cast_rne(x, dtype)` (Triton) rounds an fp32 value to the output dtype round-to-nearest-even, also under
  `TRITON_INTERPRET=1`, whose fp32->bf16 cast truncates (triton 3.9 interpreter `cast_impl` passes no rounding
  mode; checked 2026-12: 504 of 1000 random values differ from torch's `.to(bfloat16)`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU (`TRITON_INTERPRET=1`, read when triton decorates kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Read by `cast_rne` at trace time; fixed at import like triton's own choice of interpreter vs compiler.
INTERPRETING: tl.constexpr = tl.constexpr(is_interpreting())


class KernelInputError(ValueError):
    """An op was called with inputs it does not support; the message names the op and the problem."""


def _named(tensors: Sequence[torch.Tensor | tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, item in enumerate(tensors):
        if isinstance(item, tuple):
            out.append(item)
        else:
            out.append((f"arg{i}", item))
    return out


def check_inputs(
    op: str,
    *tensors: torch.Tensor | tuple[str, torch.Tensor],
    dtypes: Sequence[torch.dtype] = ACTIVATION_DTYPES,
    device: torch.device | None = None,
) -> torch.device:
    """Validate tensors for `op` (non-empty, contiguous, allowed dtype, one device the kernels can run on)."""
    named = _named(tensors)
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.numel() == 0:
            raise KernelInputError(f"{op}: `{name}` is empty (shape {list(t.shape)})")
        if not t.is_contiguous():
            raise KernelInputError(f"{op}: `{name}` is not contiguous (shape {list(t.shape)}, stride {t.stride()})")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise KernelInputError(f"{op}: `{name}` has dtype {t.dtype}, expected one of {allowed}")
    devices = {t.device for _, t in named}
    if device is not None:
        devices.add(torch.device(device))
    if len(devices) > 1:
        listing = ", ".join(f"{name}={t.device}" for name, t in named)
        raise KernelInputError(f"{op}: inputs are on mixed devices ({listing})")
    dev = devices.pop()
    if dev.type == "cpu" and not is_interpreting():
        raise KernelInputError(f"{op}: CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    if dev.type not in ("cpu", "cuda"):
        raise KernelInputError(f"{op}: device {dev} is not supported (cuda, or cpu under TRITON_INTERPRET=1)")
    return dev


def check_shape(op: str, name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    """Raise unless `t` has exactly `shape` (entries of -1 match any size)."""
    if t.ndim != len(shape) or any(want not in (-1, got) for want, got in zip(shape, t.shape, strict=True)):
        raise KernelInputError(f"{op}: `{name}` has shape {list(t.shape)}, expected {list(shape)} (-1 = any)")


# idx -> (version counter, data pointer, min, max) at its last aminmax. A MiniMax-H3 block hands the same adaln index
# tensor to four ops, and every block gets the same one; each aminmax is a device sync on CUDA, and each sync let the
# GPU run dry while the host launched the next kernels (session 12 on the H200: ~4 ms idle per block fwd+bwd at
# S=16384). Keyed by identity, held weakly; an in-place write bumps `_version`, so a changed tensor is read again.
_INDEX_RANGES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def index_range(idx: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor; read from the device once per tensor version."""
    try:
        stamp = (idx._version, idx.data_ptr())
    except RuntimeError:  # inference tensors keep no version counter: nothing to key a cached range on
        stamp = None
    cached = _INDEX_RANGES.get(idx) if stamp is not None else None
    if cached is not None and cached[:2] == stamp:
        return cached[2], cached[3]
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if stamp is not None:
        _INDEX_RANGES[idx] = (*stamp, lo, hi)
    return lo, hi


def check_index(op: str, name: str, idx: torch.Tensor, length: int, num_rows: int, device: torch.device) -> None:
    """Validate a per-row index tensor: 1-D, `length` entries, int64/int32, every entry in [0, num_rows)."""
    check_inputs(op, (name, idx), dtypes=INDEX_DTYPES, device=device)
    check_shape(op, name, idx, (length,))
    lo, hi = index_range(idx)
    if lo < 0 or hi >= num_rows:
        raise KernelInputError(f"{op}: `{name}` has entries in [{lo}, {hi}], outside the valid range [0, {num_rows})")


def check_chunk(op: str, name: str, chunk: int, num_chunks: int) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < num_chunks:
        raise KernelInputError(f"{op}: `{name}` is {chunk!r}, expected an int in [0, {num_chunks})")


def check_eps(op: str, eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise KernelInputError(f"{op}: eps must be a non-negative float, got {eps!r}")
    return float(eps)


_POISON = False


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this context every `new_empty` buffer is pre-filled with NaN (ints: their max value)."""
    global _POISON
    previous, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = previous


def new_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a buffer that a kernel must write completely (poisoned inside `poisoned_outputs()`)."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _POISON:
        t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(dtype).max)
    return t


def row_tile(block_cols: int, max_rows: int = 16) -> int:
    """Rows per program for row-wise kernels that hold a whole row of `block_cols` (a power of two) in registers.

    Keeps one program's tile at <= 8192 fp32 values (32 registers per thread at 8 warps); the real width
    H=5376 (BLOCK 8192) gets one row per program, the tiny widths get up to `max_rows` rows, which also cuts the
    number of interpreted programs on the CPU.
    """
    return max(1, min(max_rows, 8192 // block_cols))


def num_warps_for(tile_elems: int) -> int:
    """Warps for a tile of `tile_elems` fp32 values: about 32 values per thread, between 1 and 16 warps."""
    return max(1, min(16, triton.next_power_of_2(max(1, tile_elems // 1024))))


@triton.jit
def load_row_pair(a_ptr, b_ptr, t0, end, cols, cmask, H, TILE_S: tl.constexpr):
    """Tiles of rows [t0, t0 + TILE_S) below `end` of two [S, H] tensors, in their storage dtype (zeros past `end`).

    Read once, so they are evicted first. The backwards that prefetch call it one tile ahead of their math.
    """
    rows = t0 + tl.arange(0, TILE_S)
    m2 = (rows < end)[:, None] & cmask[None, :]
    offs = rows[:, None] * H + cols[None, :]
    a = tl.load(a_ptr + offs, mask=m2, other=0.0, eviction_policy="evict_first")
    b = tl.load(b_ptr + offs, mask=m2, other=0.0, eviction_policy="evict_first")
    return a, b


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """Round fp32 `x` to `dtype` to nearest even (the interpreter truncates fp32->bf16; GPUs round)."""
    if INTERPRETING and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def sigmoid_f32(x):
    # exp of a non-positive argument only, so neither branch overflows for large |x|.
    z = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
