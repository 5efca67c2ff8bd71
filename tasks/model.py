"""Presets, checkpoints and the packed FL2VA sample of the MiniMax-H3 transformer.

The model is always ``diffusers.MiniMaxH3Transformer3DModel``; nothing here re-implements it.

- **Presets** are frozen dataclasses in a plain registry (``PRESETS``): the model config plus the
  default sample. ``get_preset(name, overrides)`` applies ``key=value`` overrides to either.
- **Checkpoints** are either synthetic (deterministic from a seed, written into the store as one
  safetensors blob so they have a hash like any real checkpoint) or real (a diffusers model folder
  or safetensors files, local path or fsspec URL; hashed file by file, never copied into the store).
  ``load_model`` always goes through ``from_pretrained(torch_dtype=...)`` so mixed precision follows
  the model's ``_keep_in_fp32_modules`` exactly as diffusers loads it.
- **The sample** is one packed FL2VA request laid out by diffusers' own code
  (``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` with ``("first", "last")`` keyframe anchors,
  ``MiniMaxH3SetTimestepsStep.build_row_timesteps``), with seeded latents, audio, text conditioning
  and the seeded upstream gradients of the two outputs. It is stored as one safetensors blob.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tasks.placement import Placement, dispatch
from tasks.store import BlobCorrupt, BlobMissing, Store

# Modality tags of the released model (diffusers' MINIMAX_H3_{VIDEO,TEXT,AUDIO}_TAG).
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
# MiniMax-H3 is stereo: audio rows are packed channel-major over two channels.
AUDIO_CHANNELS = 2
# The `t` a keyframe anchor is held at (diffusers' `keyframe_noise_aug`): just short of clean (t = 1).
KEYFRAME_TIMESTEP = 0.999
KEYFRAME_ANCHORS = ("first", "last")
# Synthetic weights: the spread of biases and of norm weights around 1 (see synthetic_state_dict).
SYNTHETIC_STD = 0.02

SAMPLE_INPUTS = (
    "hidden_states",
    "audio_hidden_states",
    "encoder_hidden_states",
    "timestep",
    "timestep_indices",
    "token_tags",
    "position_ids",
    "video_indices",
    "audio_indices",
    "text_indices",
)
# Model inputs that receive a gradient (`dinput/<arg>`).
GRAD_INPUTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
# Seeded upstream gradients of the two outputs, part of the sample.
UPSTREAM_GRADS = {"sample": "grad_sample", "audio_sample": "grad_audio_sample"}


class SampleError(ValueError):
    """A malformed sample request or sample: names the field and what is wrong with it."""


@dataclass(frozen=True)
class SampleSpec:
    """One packed FL2VA request, in latent units."""

    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    text_length: int
    timestep: float = 0.5
    seed: int = 0


@dataclass(frozen=True)
class Preset:
    """A model config (``MiniMaxH3Transformer3DModel`` kwargs) and its default sample."""

    name: str
    config: Mapping[str, Any]
    sample: SampleSpec
    weight_seed: int = 0
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": _jsonable(self.config),
            "sample": dataclasses.asdict(self.sample),
            "weight_seed": self.weight_seed,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Preset:
        """The preset ``to_json`` wrote (for a process of its own: tasks/provider_process.py)."""
        return cls(doc["name"], doc["config"], SampleSpec(**doc["sample"]), doc["weight_seed"])


_REAL_WIDTHS = dict(
    num_attention_heads=56,
    attention_head_dim=128,
    hidden_size=5376,
    ffn_dim=14336,
    in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=5120,
    freq_dim=256,
    time_embed_hidden_dim=5376,
    time_embed_dim=2688,
    rope_freq_dim=16,
)
# S = 512 text + 2 x 960 keyframe rows + 2 x 736 audio rows + 13 x 960 video rows = 16384.
_REAL_SAMPLE = SampleSpec(latent_frames=13, latent_height=48, latent_width=80, audio_latents=736, text_length=512)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        dict(
            num_attention_heads=4,
            attention_head_dim=32,
            hidden_size=96,
            num_layers=3,
            num_refiner_layers=2,
            ffn_dim=256,
            in_channels=4,
            audio_in_channels=8,
            patch_size=(1, 2, 2),
            text_dim=64,
            freq_dim=32,
            time_embed_hidden_dim=96,
            time_embed_dim=48,
            rope_freq_dim=4,
        ),
        # S = 6 text + 32 keyframe rows + 10 audio rows + 48 video rows = 96 (CPU seconds). At S=36 the
        # oneDNN-off provider was byte-identical to the default on most tensors; at 96 all three differ.
        SampleSpec(latent_frames=3, latent_height=8, latent_width=8, audio_latents=5, text_length=6),
        description="CPU seconds: hidden 96, 4 heads x 32, 3 blocks, 2 refiner blocks, S=96",
    ),
    "small": Preset(
        "small",
        dict(
            num_attention_heads=8,
            attention_head_dim=128,
            hidden_size=1024,
            num_layers=4,
            num_refiner_layers=1,
            ffn_dim=2816,
            in_channels=24,
            audio_in_channels=32,
            patch_size=(1, 2, 2),
            text_dim=1024,
            freq_dim=256,
            time_embed_hidden_dim=1024,
            time_embed_dim=512,
            rope_freq_dim=16,
        ),
        # S = 64 text + 512 keyframe rows + 200 audio rows + 1280 video rows = 2056.
        SampleSpec(latent_frames=5, latent_height=32, latent_width=32, audio_latents=100, text_length=64),
        description="one GPU, minutes: hidden 1024, 8 heads x 128 (real head dim), 4 blocks, S=2056",
    ),
    "block": Preset(
        "block",
        dict(_REAL_WIDTHS, num_layers=2, num_refiner_layers=1),
        _REAL_SAMPLE,
        description="real widths (hidden 5376, 56 x 128, ffn 14336), 2 blocks, 1 refiner block, S=16384",
    ),
    "full": Preset(
        "full",
        dict(_REAL_WIDTHS, num_layers=50, num_refiner_layers=2),
        _REAL_SAMPLE,
        description="the released 50-block config (about 33B parameters: several GPUs)",
    ),
}


def get_preset(name: str, overrides: Mapping[str, Any] | None = None) -> Preset:
    """Return preset ``name`` with ``overrides`` applied to its model config or its sample fields."""
    if name not in PRESETS:
        raise SampleError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if not overrides:
        return preset
    sample_fields = {f.name for f in dataclasses.fields(SampleSpec)}
    config, sample = dict(preset.config), {}
    weight_seed = preset.weight_seed
    for key, value in overrides.items():
        if key in sample_fields:
            sample[key] = value
        elif key == "weight_seed":
            weight_seed = int(value)
        elif key in config or key in _model_config_keys():
            config[key] = tuple(value) if key == "patch_size" else value
        else:
            raise SampleError(f"unknown override {key!r}: not a model config field, a sample field or weight_seed")
    return Preset(name, config, dataclasses.replace(preset.sample, **sample), weight_seed, preset.description)


def _model_config_keys() -> set[str]:
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel

    return set(inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters) - {"self"}


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Parse ``key=value`` strings (values as JSON where they parse, else strings)."""
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SampleError(f"override {item!r} is not of the form key=value")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return overrides


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRef:
    """What identifies a checkpoint: the hash of its identity document (config + weight hashes)."""

    sha256: str
    source: str  # "synthetic" or "real"
    config: Mapping[str, Any]
    weights: Mapping[str, str]  # file name -> sha256 of its bytes
    location: str | None = field(default=None, compare=False)  # where real weights live (never hashed)

    def identity(self) -> dict[str, Any]:
        return {"source": self.source, "config": _jsonable(self.config), "weights": dict(self.weights)}


def _jsonable(config: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(config), sort_keys=True, default=list))


def synthetic_state_dict(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic FP32 weights: each parameter drawn from its own generator seeded by (seed, name).

    Seeding per name makes every tensor independent of module construction order and of the other
    parameters, so changing ``num_layers`` leaves the shared blocks' weights unchanged.

    Scales are those of a live network, so every node's error reaches the block outputs: linear
    weights N(0, 1/fan_in) (unit gain at any width), biases N(0, SYNTHETIC_STD), norm weights
    1 + N(0, SYNTHETIC_STD), and the AdaLN gate chunks' biases centred on 1. With gates near 0
    (std-0.02 weights everywhere) a block's branches barely touch the residual stream, and a
    perturbed attention node would not show in the block output at all.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    hidden = int(config["hidden_size"])
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        module = name.split(".")[-2]
        if "norm" in module and name.endswith("weight"):
            values = 1.0 + SYNTHETIC_STD * values
        elif param.ndim == 2:
            values = values / math.sqrt(param.shape[1])
        else:
            values = SYNTHETIC_STD * values
        if name.endswith("adaln_proj.linear.bias"):
            # [modality][shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp] x hidden
            chunks = values.view(-1, 6, hidden)
            chunks[:, 2] += 1.0
            chunks[:, 5] += 1.0
        state[name] = values
    return state


# Bump when synthetic_state_dict draws different weights: it keys the pointer that lets a store skip redrawing.
SYNTHETIC_FORMAT = 2


def write_synthetic_checkpoint(store: Store, preset: Preset) -> CheckpointRef:
    """Write the preset's synthetic checkpoint into the store, or find the one already there.

    Drawing the weights costs seconds at real widths (1.75B values for ``block``) and every flow step
    that needs the checkpoint asks for it, so ``refs/synthetic/<key>`` remembers the checkpoint of a
    (config, seed, format); the pointer is only trusted while the weights blob it names is present.
    """
    key_doc = {"config": _jsonable(preset.config), "seed": preset.weight_seed, "format": SYNTHETIC_FORMAT}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    pointer = store.read_ref("synthetic", key)
    if pointer is not None and all(store.has_blob(sha) for sha in pointer["weights"].values()):
        return load_checkpoint_ref(store, pointer["sha256"])
    state = synthetic_state_dict(preset.config, preset.weight_seed)
    ref = store.put_bytes(save_safetensors(state))
    del state
    weights = {"diffusion_pytorch_model.safetensors": ref.sha256}
    checkpoint = _checkpoint_ref(store, "synthetic", preset.config, weights, location=None)
    store.write_ref("synthetic", key, {"sha256": checkpoint.sha256, "weights": weights})
    return checkpoint


def open_real_checkpoint(
    store: Store, location: str, preset: Preset, storage_options: dict | None = None
) -> CheckpointRef:
    """Hash a real checkpoint: a diffusers model folder, or one or more ``.safetensors`` files.

    ``location`` is a local path or an fsspec URL; several files are comma-separated. A folder's
    ``config.json`` wins over the preset's config; plain files use the preset's config.
    """
    folder_config, weights = _hash_checkpoint_files(location, storage_options)
    config = folder_config if folder_config is not None else dict(preset.config)
    # The identity holds no path: the same weights at another location are the same checkpoint.
    return _checkpoint_ref(store, "real", config, weights, location=location)


def _hash_checkpoint_files(location: str, storage_options: dict | None) -> tuple[dict | None, dict[str, str]]:
    """Return (the folder's config.json or None, {weight file name: sha256})."""
    fs, paths = _checkpoint_files(location, storage_options)
    config: dict | None = None
    weights: dict[str, str] = {}
    for path in paths:
        if os.path.basename(path) == "config.json":
            with fs.open(path, "rb") as handle:
                config = {k: v for k, v in json.load(handle).items() if not k.startswith("_")}
            continue
        digest = hashlib.sha256()
        with fs.open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
        weights[os.path.basename(path)] = digest.hexdigest()
    if not weights:
        raise FileNotFoundError(f"no .safetensors weights found at the checkpoint location ({len(paths)} files seen)")
    return config, weights


def _checkpoint_files(location: str, storage_options: dict | None) -> tuple[Any, list[str]]:
    paths: list[str] = []
    fs = None
    for part in location.split(","):
        fs, path = fsspec.core.url_to_fs(part.strip(), **(storage_options or {}))
        if fs.isdir(path):
            entries = sorted(fs.ls(path, detail=False))
            paths += [p for p in entries if p.endswith((".safetensors", "config.json"))]
        elif fs.exists(path):
            paths.append(path)
        else:
            raise FileNotFoundError(f"checkpoint file not found: {part.strip()!r}")
    return fs, paths


def _checkpoint_ref(
    store: Store, source: str, config: Mapping[str, Any], weights: dict[str, str], location: str | None
) -> CheckpointRef:
    ref = CheckpointRef(sha256="", source=source, config=_jsonable(config), weights=weights, location=location)
    blob = store.put_json(ref.identity())
    return dataclasses.replace(ref, sha256=blob.sha256)


def load_checkpoint_ref(store: Store, sha256: str, location: str | None = None) -> CheckpointRef:
    """Rebuild a ``CheckpointRef`` from its identity blob (verified on read)."""
    identity = store.get_json(sha256, name="checkpoint")
    return CheckpointRef(sha256, identity["source"], identity["config"], identity["weights"], location)


def verify_checkpoint(store: Store, checkpoint: CheckpointRef, storage_options: dict | None = None) -> None:
    """Re-hash every weight file of the checkpoint; raise naming the file on any mismatch."""
    if checkpoint.location is None:
        for name, sha in checkpoint.weights.items():
            if not store.has_blob(sha):
                raise BlobMissing(f"checkpoint weights {name} (sha256 {sha}) are missing from the store")
            store.get_bytes(sha, name=f"checkpoint/{name}")
        return
    _, actual = _hash_checkpoint_files(checkpoint.location, storage_options)
    for name, sha in checkpoint.weights.items():
        if actual.get(name) != sha:
            raise BlobCorrupt(
                f"checkpoint file {name}: expected sha256 {sha}, found {actual.get(name)}; "
                "the checkpoint changed since the reference was made: regenerate the reference"
            )


def load_model(
    store: Store, checkpoint: CheckpointRef, dtype: torch.dtype, device: str | torch.device,
    placement: Placement | None = None,
) -> Any:
    """Load ``MiniMaxH3Transformer3DModel`` through ``from_pretrained(torch_dtype=dtype)``.

    Going through diffusers' own loader is what makes ``_keep_in_fp32_modules`` apply exactly as in
    production (``model.to(torch.bfloat16)`` would cast those modules too). A split ``placement``
    loads each module straight onto its device through the accelerate device map (the whole model is
    never on one device) and dispatches it; otherwise the model goes to ``device``.
    """
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.utils import logging as diffusers_logging

    split = placement is not None and placement.is_split
    with tempfile.TemporaryDirectory(prefix="h3gate-ckpt-") as folder:
        _materialize_folder(store, checkpoint, Path(folder))
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        try:
            model = MiniMaxH3Transformer3DModel.from_pretrained(
                folder, torch_dtype=dtype, **({"device_map": placement.device_map()} if split else {})
            )
        finally:
            diffusers_logging.set_verbosity(verbosity)
    if split:
        dispatch(model, placement)
    else:
        model.to(device)
    model.train(False)
    return model


def _materialize_folder(store: Store, checkpoint: CheckpointRef, folder: Path) -> None:
    """Lay out a diffusers model folder (config.json + weights + shard index) for ``from_pretrained``."""
    from diffusers import MiniMaxH3Transformer3DModel

    config = dict(checkpoint.config, _class_name=MiniMaxH3Transformer3DModel.__name__)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(checkpoint.weights)
    if checkpoint.location is None:
        for name in names:
            (folder / name).write_bytes(store.get_bytes(checkpoint.weights[name], name=f"checkpoint/{name}"))
    else:
        fs, paths = _checkpoint_files(checkpoint.location, None)
        for path in paths:
            if os.path.basename(path) in checkpoint.weights:
                local = folder / os.path.basename(path)
                if isinstance(fs, LocalFileSystem):
                    local.symlink_to(os.path.abspath(path))
                else:
                    fs.get(path, str(local))
    if names != ["diffusion_pytorch_model.safetensors"]:
        weight_map = {}
        for name in names:
            with open(folder / name, "rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(header_len))
            weight_map.update({key: name for key in header if key != "__metadata__"})
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


# ---------------------------------------------------------------------------------------------
# The packed FL2VA sample
# ---------------------------------------------------------------------------------------------


def validate_spec(config: Mapping[str, Any], spec: SampleSpec) -> None:
    """Reject sample requests that cannot be laid out, naming the field."""
    _, patch_h, patch_w = tuple(config.get("patch_size", (1, 2, 2)))
    for name in ("latent_frames", "latent_height", "latent_width", "audio_latents", "text_length"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SampleError(f"sample field {name} must be a positive integer, got {value!r}")
    if spec.latent_height % patch_h or spec.latent_width % patch_w:
        raise SampleError(
            f"latent_height x latent_width = {spec.latent_height} x {spec.latent_width} does not patchify "
            f"with patch (h, w) = ({patch_h}, {patch_w})"
        )
    if not 0.0 <= float(spec.timestep) <= 1.0:
        raise SampleError(f"sample field timestep must be in [0, 1] (1 is clean), got {spec.timestep!r}")
    rotary = 6 * int(config.get("rope_freq_dim", 16))
    if rotary > int(config.get("attention_head_dim", 128)):
        raise SampleError(f"rope_freq_dim={config.get('rope_freq_dim')} rotates {rotary} channels > head dim")


def build_sample(config: Mapping[str, Any], spec: SampleSpec) -> dict[str, torch.Tensor]:
    """Build the packed FL2VA sample with diffusers' layout code and seeded contents (all on CPU)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )

    validate_spec(config, spec)
    patch_size = tuple(config.get("patch_size", (1, 2, 2)))
    text_tags = torch.full((spec.text_length,), TEXT_TAG, dtype=torch.long)
    position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond_video, n_cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_tags,
            spec.latent_frames,
            spec.latent_height,
            spec.latent_width,
            spec.audio_latents,
            patch_size,
            AUDIO_CHANNELS,
            AUDIO_TAG,
            VIDEO_TAG,
            KEYFRAME_ANCHORS,
        )
    )
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx,
        audio_idx,
        n_cond_video,
        n_cond_audio,
        spec.text_length,
        float(spec.timestep),
        float(spec.timestep),
        max(float(spec.timestep), KEYFRAME_TIMESTEP),
        1.0,
    )
    generator = torch.Generator().manual_seed(spec.seed)
    patch_dim = int(config["in_channels"]) * patch_size[0] * patch_size[1] * patch_size[2]
    sample = {
        "hidden_states": torch.randn(1, video_idx.numel(), patch_dim, generator=generator),
        "audio_hidden_states": torch.randn(1, audio_idx.numel(), int(config["audio_in_channels"]), generator=generator),
        "encoder_hidden_states": torch.randn(1, spec.text_length, int(config["text_dim"]), generator=generator),
        "timestep": timestep.to(torch.float32),
        "timestep_indices": timestep_indices.to(torch.long),
        "token_tags": token_tags,
        "position_ids": position_ids,
        "video_indices": video_idx.to(torch.long),
        "audio_indices": audio_idx.to(torch.long),
        "text_indices": text_idx.to(torch.long),
    }
    sample["grad_sample"] = torch.randn(sample["hidden_states"].shape, generator=generator)
    sample["grad_audio_sample"] = torch.randn(sample["audio_hidden_states"].shape, generator=generator)
    validate_sample(config, sample)
    return sample


def validate_sample(config: Mapping[str, Any], sample: Mapping[str, torch.Tensor]) -> None:
    """Check a sample's tensors agree with each other and with the model config, naming the field."""
    missing = [k for k in (*SAMPLE_INPUTS, *UPSTREAM_GRADS.values()) if k not in sample]
    if missing:
        raise SampleError(f"sample is missing {', '.join(missing)}")
    seq = sample["position_ids"].shape[0]
    if sample["position_ids"].shape != (seq, 3):
        raise SampleError(f"position_ids must be (seq_len, 3), got {list(sample['position_ids'].shape)}")
    for name in ("token_tags", "timestep_indices"):
        if sample[name].shape != (seq,):
            raise SampleError(f"{name} must be ({seq},) to match position_ids, got {list(sample[name].shape)}")
    tags = sample["token_tags"]
    if tags.numel() and (tags.min() < 0 or tags.max() > 2):
        raise SampleError(f"token_tags must be 0 (video), 1 (text) or 2 (audio); found {sorted(set(tags.tolist()))}")
    n_t = sample["timestep"].numel()
    ti = sample["timestep_indices"]
    if ti.numel() and (ti.min() < 0 or ti.max() >= n_t):
        raise SampleError(f"timestep_indices must index the {n_t} timesteps; found range [{ti.min()}, {ti.max()}]")
    rows = torch.cat([sample["video_indices"], sample["audio_indices"], sample["text_indices"]])
    if rows.numel() != seq or not torch.equal(rows.sort().values, torch.arange(seq)):
        raise SampleError(f"video/audio/text indices must partition the {seq} packed rows exactly once")
    widths = {
        "hidden_states": ("video_indices", int(config["in_channels"]) * _prod(config.get("patch_size", (1, 2, 2)))),
        "audio_hidden_states": ("audio_indices", int(config["audio_in_channels"])),
        "encoder_hidden_states": ("text_indices", int(config["text_dim"])),
        "grad_sample": ("video_indices", None),
        "grad_audio_sample": ("audio_indices", None),
    }
    for name, (index_name, width) in widths.items():
        tensor, n_rows = sample[name], sample[index_name].numel()
        if tensor.ndim != 3 or tensor.shape[1] != n_rows or (width is not None and tensor.shape[2] != width):
            expected = f"(batch, {n_rows}, {width if width is not None else '...'})"
            raise SampleError(f"{name} has shape {list(tensor.shape)}; expected {expected} to match {index_name}")


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def write_sample(store: Store, sample: Mapping[str, torch.Tensor]) -> str:
    """Store the sample as one safetensors blob and return its sha256."""
    return store.put_bytes(save_safetensors({k: v.contiguous() for k, v in sample.items()})).sha256


def read_sample(store: Store, sha256: str, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Read (verified) and validate a stored sample."""
    sample = load_safetensors(store.get_bytes(sha256, name="sample"))
    validate_sample(config, sample)
    return sample


def model_inputs(sample: Mapping[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    """The forward kwargs on ``device``; the three differentiable inputs are fresh leaves with grad."""
    inputs = {name: sample[name].to(device) for name in SAMPLE_INPUTS}
    for name in GRAD_INPUTS:
        inputs[name] = inputs[name].detach().clone().requires_grad_(True)
    return inputs
