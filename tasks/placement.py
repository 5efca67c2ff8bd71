"""Layer-wise placement of one MiniMax-H3 model over several devices, through accelerate's device map.

A ``Placement`` splits ``transformer_blocks`` into contiguous ranges, one range per entry, each entry
on a device (entries may share a device: two ranges on one GPU is how the split is checked against
the unsplit run). ``device_map()`` turns it into the map ``from_pretrained(device_map=...)`` loads
onto and accelerate's ``dispatch_model`` hooks: each entry's modules run on its device, activations
cross devices through the hooks' ``.to()`` and gradients come back through autograd.

Boundary modules sit with their neighbours: the input side (``rope``, the three input projections,
the token refiner, the time embedding) on the first entry's device, and so does the output head
(``norm_out``, ``proj_out``, ``audio_proj_out``). The head's neighbour is the input side, not the
last block: the model's own forward indexes the head's outputs with the input-side index tensors
(``proj_out(...).index_select(1, video_indices)``) outside any module, so the head must share their
device or that index would cross devices.

Placement never changes what a run computes, so it is run *metadata*, not part of run identity.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

INPUT_SIDE = ("rope", "proj_in", "audio_proj_in", "context_embedder", "token_refiner", "time_proj", "time_embedder")
OUTPUT_HEAD = ("norm_out", "proj_out", "audio_proj_out")
BLOCKS = "transformer_blocks"


class PlacementError(ValueError):
    """A placement that cannot be built: names the entry and what is wrong with it."""


@dataclass(frozen=True)
class Placement:
    """Contiguous block ranges in order: entry ``i`` holds ``block_counts[i]`` blocks on ``devices[i]``."""

    devices: tuple[str, ...]
    block_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.devices or len(self.devices) != len(self.block_counts):
            raise PlacementError("a placement needs one block count per device entry")
        for device, count in zip(self.devices, self.block_counts, strict=True):
            if count < 1:
                raise PlacementError(f"entry {device}={count}: every entry must hold at least one block")
            _device_name(device)

    @classmethod
    def single(cls, device: str, num_layers: int) -> Placement:
        """The whole model on one device (the unsplit run)."""
        return cls((_device_name(device),), (num_layers,))

    @classmethod
    def even(cls, devices: Sequence[str], num_layers: int) -> Placement:
        """``num_layers`` blocks over ``devices`` as evenly as possible, earlier entries taking the remainder."""
        if len(devices) > num_layers:
            raise PlacementError(f"cannot split {num_layers} blocks over {len(devices)} devices: "
                                 "each entry needs at least one block")
        base, extra = divmod(num_layers, len(devices))
        return cls(tuple(_device_name(d) for d in devices),
                   tuple(base + (1 if i < extra else 0) for i in range(len(devices))))

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> Placement:
        """``"cuda:0,cuda:1"`` (even split) or ``"cuda:0=26,cuda:1=24"`` (block counts, summing to ``num_layers``)."""
        items = [item.strip() for item in spec.split(",") if item.strip()]
        if not items:
            raise PlacementError("empty placement: give devices like 'cuda:0,cuda:1' or 'cuda:0=26,cuda:1=24'")
        counted = ["=" in item for item in items]
        if not any(counted):
            return cls.even(items, num_layers)
        if not all(counted):
            raise PlacementError(f"placement {spec!r}: give a block count for every entry or for none")
        devices, counts = [], []
        for item in items:
            device, _, count = item.partition("=")
            if not count.strip().isdigit():
                raise PlacementError(f"placement entry {item!r}: the block count must be a whole number")
            devices.append(_device_name(device.strip()))
            counts.append(int(count))
        placement = cls(tuple(devices), tuple(counts))
        if sum(counts) != num_layers:
            raise PlacementError(f"placement {spec!r} holds {sum(counts)} blocks; the model has {num_layers}")
        return placement

    @property
    def main_device(self) -> str:
        """Where the inputs, the input side, the output head and the outputs live."""
        return self.devices[0]

    @property
    def num_layers(self) -> int:
        return sum(self.block_counts)

    @property
    def is_split(self) -> bool:
        return len(self.devices) > 1

    def ranges(self) -> list[range]:
        """The block indices of each entry."""
        out, start = [], 0
        for count in self.block_counts:
            out.append(range(start, start + count))
            start += count
        return out

    def device_map(self) -> dict[str, str]:
        """The accelerate device map: top-level modules and one key per transformer block."""
        mapping = {name: self.main_device for name in (*INPUT_SIDE, *OUTPUT_HEAD)}
        for device, blocks in zip(self.devices, self.ranges(), strict=True):
            mapping.update({f"{BLOCKS}.{index}": device for index in blocks})
        return mapping

    def entry_of(self, module_name: str) -> int:
        """The entry a (sub)module belongs to: its block's range, else the first entry."""
        parts = module_name.split(".")
        if parts[0] == BLOCKS and len(parts) > 1:
            index = int(parts[1])
            return next(i for i, blocks in enumerate(self.ranges()) if index in blocks)
        return 0

    def to_json(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "block_counts": list(self.block_counts)}

    def describe(self) -> str:
        ranges = zip(self.devices, self.ranges(), strict=True)
        return ", ".join(f"{device}: blocks {r.start}-{r.stop - 1}" for device, r in ranges)


def dispatch(model: torch.nn.Module, placement: Placement) -> None:
    """Attach accelerate's device hooks when the split keeps every entry on one device.

    ``from_pretrained(device_map=...)`` already dispatches a map over several devices; a map over one
    device it only loads there, without hooks. Forcing the hooks makes a same-device split run the
    exact code path of a multi-device one (the hooks' moves become no-ops), which is what lets the
    split be checked byte for byte against the unsplit run on one GPU or on the CPU.
    """
    from accelerate import dispatch_model

    if placement.is_split and len(set(placement.devices)) == 1:
        # accelerate warns that "cpu" entries are offloaded to meta; with the CPU as main device they are not.
        big_modeling_log = logging.getLogger("accelerate.big_modeling")
        level = big_modeling_log.level
        big_modeling_log.setLevel(logging.ERROR)
        try:
            dispatch_model(model, placement.device_map(), main_device=placement.main_device, force_hooks=True)
        finally:
            big_modeling_log.setLevel(level)


def lanes(device: str, split: str, gpus_per_run: int, visible: int) -> list[str]:
    """The placement spec of each lane (runs in one lane go one after another; lanes run concurrently).

    An explicit ``split`` is one lane. On ``cuda`` with ``visible`` GPUs, each lane is a group of
    ``gpus_per_run`` consecutive GPUs (``cuda:0,cuda:1`` then ``cuda:2,cuda:3`` ...), the model split
    evenly over it. Anything else (the CPU, a pinned ``cuda:N``, one GPU) is one lane on ``device``.
    """
    if gpus_per_run < 1:
        raise PlacementError(f"gpus_per_run must be at least 1, got {gpus_per_run}")
    if split:
        return [split]
    if device != "cuda" or (visible < 2 and gpus_per_run == 1):
        if gpus_per_run > 1:
            raise PlacementError(f"gpus_per_run={gpus_per_run} needs device 'cuda' (all visible GPUs), got {device!r}")
        return [device]
    if gpus_per_run > visible:
        raise PlacementError(f"gpus_per_run={gpus_per_run} but only {visible} GPUs are visible")
    groups = visible // gpus_per_run
    return [",".join(f"cuda:{g * gpus_per_run + i}" for i in range(gpus_per_run)) for g in range(groups)]


def assign_lanes(providers: Sequence[str], lane_specs: Sequence[str]) -> dict[str, str]:
    """Providers round-robin over lanes: provider ``i`` runs in lane ``i mod len(lanes)``."""
    return {name: lane_specs[i % len(lane_specs)] for i, name in enumerate(providers)}


def lane_target(spec: str) -> tuple[str, str]:
    """(device, split) of a lane spec: a plain device runs unsplit there; a split runs from its first device."""
    entries = [item.strip() for item in spec.split(",") if item.strip()]
    if len(entries) == 1 and "=" not in entries[0]:
        return entries[0], ""
    return _device_name(entries[0].partition("=")[0].strip()), spec


def _device_name(device: str) -> str:
    """The canonical name of a torch device (``cuda:0``), or PlacementError naming the bad one."""
    try:
        return str(torch.device(device))
    except RuntimeError as exc:
        raise PlacementError(f"{device!r} is not a torch device ({exc})") from None
