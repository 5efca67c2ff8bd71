"""Presets, synthetic checkpoints, loading with diffusers' mixed precision, and the packed sample."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from tasks import model as model_lib
from tasks.model import SampleError, SampleSpec


def test_tiny_sample_is_diffusers_layout(tiny):
    sample = model_lib.build_sample(tiny.config, tiny.sample)
    # 6 text + 2 keyframes x 16 rows + 5 audio latents x 2 channels + 3 frames x 16 rows
    assert sample["position_ids"].shape == (96, 3)
    assert sample["text_indices"].tolist() == list(range(6))
    assert sample["video_indices"].numel() == 32 + 48
    assert sample["audio_indices"].numel() == 10
    # keyframe rows sit at t = 0.999, the targets at the requested timestep
    assert sample["timestep"].tolist() == pytest.approx([0.5, 0.999])
    keyframes = sample["video_indices"][:32]
    assert sample["timestep"][sample["timestep_indices"][keyframes]].tolist() == pytest.approx([0.999] * 32)
    assert set(sample["token_tags"].tolist()) == {0, 1, 2}


def test_sample_is_seeded(tiny):
    a = model_lib.build_sample(tiny.config, tiny.sample)
    b = model_lib.build_sample(tiny.config, tiny.sample)
    c = model_lib.build_sample(tiny.config, dataclasses.replace(tiny.sample, seed=1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["hidden_states"], c["hidden_states"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(latent_height=7), "does not patchify"),
        (dict(latent_frames=0), "latent_frames must be a positive integer"),
        (dict(text_length=-1), "text_length"),
        (dict(timestep=1.5), "timestep must be in"),
    ],
)
def test_bad_sample_requests_are_named(tiny, change, message):
    with pytest.raises(SampleError, match=message):
        model_lib.build_sample(tiny.config, dataclasses.replace(tiny.sample, **change))


def test_malformed_samples_are_named(tiny):
    sample = model_lib.build_sample(tiny.config, tiny.sample)
    bad_tags = dict(sample, token_tags=sample["token_tags"].clone().fill_(5))
    with pytest.raises(SampleError, match="token_tags must be"):
        model_lib.validate_sample(tiny.config, bad_tags)
    short = dict(sample, hidden_states=sample["hidden_states"][:, :-1])
    with pytest.raises(SampleError, match="hidden_states has shape"):
        model_lib.validate_sample(tiny.config, short)
    with pytest.raises(SampleError, match="missing"):
        model_lib.validate_sample(tiny.config, {k: v for k, v in sample.items() if k != "timestep"})


def test_overrides_and_unknown_keys():
    preset = model_lib.get_preset("tiny", {"num_layers": 1, "latent_frames": 2})
    assert preset.config["num_layers"] == 1 and preset.sample.latent_frames == 2
    with pytest.raises(SampleError, match="unknown override 'bogus'"):
        model_lib.get_preset("tiny", {"bogus": 1})
    with pytest.raises(SampleError, match="unknown preset"):
        model_lib.get_preset("huge")
    assert model_lib.parse_overrides(["num_layers=2", "timestep=0.25"]) == {"num_layers": 2, "timestep": 0.25}


def test_synthetic_weights_are_per_name(tiny):
    a = model_lib.synthetic_state_dict(tiny.config, 0)
    fewer = model_lib.synthetic_state_dict(dict(tiny.config, num_layers=1), 0)
    assert torch.equal(a["transformer_blocks.0.attn.to_q.weight"], fewer["transformer_blocks.0.attn.to_q.weight"])
    assert not torch.equal(a["transformer_blocks.0.attn.to_q.weight"], a["transformer_blocks.1.attn.to_q.weight"])


def test_bf16_load_keeps_fp32_modules(store, tiny):
    checkpoint = model_lib.write_synthetic_checkpoint(store, tiny)
    again = model_lib.write_synthetic_checkpoint(store, tiny)
    assert checkpoint.sha256 == again.sha256
    model = model_lib.load_model(store, checkpoint, torch.bfloat16, "cpu")
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["proj_in.weight"] == torch.float32
    assert dtypes["time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["audio_proj_out.bias"] == torch.float32
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == torch.bfloat16
    assert dtypes["transformer_blocks.0.adaln_proj.linear.weight"] == torch.bfloat16


def test_real_checkpoint_folder_and_files(store, tiny, tmp_path):
    state = model_lib.synthetic_state_dict(tiny.config, 3)
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(tmp_path / "b.safetensors"))
    files = f"{tmp_path / 'a.safetensors'},{tmp_path / 'b.safetensors'}"
    checkpoint = model_lib.open_real_checkpoint(store, files, tiny)
    assert checkpoint.source == "real" and str(tmp_path) not in str(checkpoint.identity())
    model = model_lib.load_model(store, checkpoint, torch.float32, "cpu")
    assert torch.equal(model.state_dict()["transformer_blocks.2.ff.net.2.weight"],
                       state["transformer_blocks.2.ff.net.2.weight"])
    model_lib.verify_checkpoint(store, checkpoint)
    save_file({k: state[k] * 2 for k in names[:half]}, str(tmp_path / "a.safetensors"))
    with pytest.raises(Exception, match="checkpoint file a.safetensors"):
        model_lib.verify_checkpoint(store, checkpoint)


def test_missing_checkpoint_is_named(store, tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        model_lib.open_real_checkpoint(store, str(tmp_path / "nothing.safetensors"), tiny)


def test_sample_spec_validation_rejects_non_int():
    preset = model_lib.get_preset("tiny")
    with pytest.raises(SampleError, match="latent_width"):
        model_lib.validate_spec(preset.config, SampleSpec(3, 8, 8.0, 5, 6))  # type: ignore[arg-type]
