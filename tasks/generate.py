"""The generation gate: one complete FL2VA sampling trajectory, candidate against FP32 and the BF16 providers.

``run_generate(store, reference, preset, checkpoint, device=..., num_steps=30, nodes=None, overrides=None)``
refuses to start (``MissingVerdict``, naming the pointer it looked for) unless the numerical gate has passed for
the same preset, device type, checkpoint and candidate (``gate.passing_verdict_key``; the candidate is
``Binding.describe()`` of the strictly bound model *without* overrides, so an override is an injection on top of
a qualified candidate). The check runs on a meta-device model, before any weights load.

Trajectory (``run_trajectory``): diffusers' FL2VA denoise loop step for step (``MiniMaxH3SetTimestepsStep``,
``MiniMaxH3LoopDenoiser``, ``MiniMaxH3LoopSchedulerStep``), in the transformer's latent space:
- two ``MiniMaxH3Scheduler`` (video shift 12, audio shift 3), ``set_timesteps(num_steps)``: num_steps grid
  points with the terminal 0 included, hence ``num_steps - 1`` model evaluations (diffusers' own count);
- step i: ``build_row_timesteps(video t_i, audio t_i, keyframe max(t_i, 0.999), audio reference 1.0)``;
- ``model(hidden_states=latents[None], audio_hidden_states=audio[None], encoder_hidden_states, timestep,
  timestep_indices, layout)`` gives the data-ward velocities; ``scheduler.step(v[0, n_cond:].float(), t,
  latents[n_cond:])`` updates the generated rows only; the keyframe rows are never written.
Conditioning (``build_conditioning``): the layout from ``build_packed_sequence`` (anchors first/last), seeded
from the preset's sample seed: clean keyframe latents noised with ``scale_noise(x, 0.999, noise)`` as
``MiniMaxH3PrepareConditionLatentsStep`` does, then the generated video noise, the audio noise and the text
embeddings, in that draw order, in row layout (patchify only permutes). No VAE or text encoder.

Every trajectory (FP32 reference under ``fp32``, the FP32 noise run under ``fp32-alt``, each BF16 provider of
the reference, the candidate twice under the default provider) starts from the same conditioning. Compared
tensors, float32 on CPU, in this order: ``step{i}/video_velocity`` and ``step{i}/audio_velocity`` (the target
rows' velocities, as ``scheduler.step`` consumes them), then ``final/video_latents``, ``final/audio_latents``
(target rows after the last update).

Rule: ``rules.calibrate`` leave-one-out over the providers' per-tensor relative L2 against the FP32 trajectory,
floor ``rules.derive_floor`` of the FP32-alt trajectory's errors; ``rules.verdict`` over every tensor, so the
candidate passes iff the final latents and the worst step pass. ``passed`` also needs determinism and every
bound node to have run forward. Final-latent metrics (not gated): relative L2, max abs, cosine similarity and
``PSNR = 10 log10(peak^2 / MSE)`` with ``peak = max(ref) - min(ref)``, all in float64.
Determinism: the candidate trajectory runs twice; the sha256 of every model output and every updated latent is
compared in execution order; the first mismatch is reported as (step, tensor).

Documents: ``runs/<gate_id>-generate-<hash>/generate.json`` (``GENERATE_SCHEMA``); the hash covers the
steps, the conditioning, the candidate with its overrides and the provider set.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tasks import rules
from tasks.capture import DTYPES
from tasks.compare import TensorComparison, canonical_json, compare_tensors, json_float
from tasks.gate import CANDIDATE_DTYPE, PASSING_VERDICTS, passing_verdict_key
from tasks.model import (
    AUDIO_CHANNELS,
    AUDIO_TAG,
    KEYFRAME_ANCHORS,
    KEYFRAME_TIMESTEP,
    TEXT_TAG,
    VIDEO_TAG,
    CheckpointRef,
    Preset,
    SampleSpec,
    load_model,
    validate_spec,
)
from tasks.provider_process import run_in_own_process, store_request
from tasks.providers import Provider, activate, fp32_alt_provider, fp32_provider, needs_own_process, resolve_provider
from tasks.reference import ReferenceInfo
from tasks.store import Store

# The released checkpoints' schedules (diffusers' MiniMaxH3SetTimestepsStep): video shift 12, audio shift 3.
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0
# diffusers passes 1.0 (clean) as the audio reference rows' timestep; FL2VA has no such rows.
CONDITION_AUDIO_TIMESTEP = 1.0
GENERATE_SCHEMA = "h3gate.generate/1"
GENERATE_FILE = "generate.json"
FINAL_TENSORS = ("final/video_latents", "final/audio_latents")
LAYOUT = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


class GenerateError(RuntimeError):
    """The generation gate cannot run (mismatched evidence, a schedule diffusers would not run)."""


class MissingVerdict(GenerateError):
    """No passing numerical verdict for this preset, device type, checkpoint and candidate."""


# -- conditioning and trajectory -----------------------------------------------------------------


@dataclass(frozen=True)
class Conditioning:
    """Initial rows and layout of one FL2VA request (all on CPU, float32 rows)."""

    video: torch.Tensor  # [Nv, in_channels * patch volume]: keyframe rows first, then generated rows
    audio: torch.Tensor  # [Na, audio_in_channels], channel-major
    prompt_embeds: torch.Tensor  # [1, T, text_dim]
    layout: Mapping[str, torch.Tensor]
    num_condition_video_rows: int
    num_condition_audio_rows: int

    def sha256(self) -> str:
        digest = hashlib.sha256(f"{self.num_condition_video_rows},{self.num_condition_audio_rows}".encode())
        for name, t in (("video", self.video), ("audio", self.audio), ("prompt", self.prompt_embeds),
                        *sorted(self.layout.items())):
            digest.update(name.encode() + b"\0" + _tensor_bytes(t))
        return digest.hexdigest()


def build_conditioning(config: Mapping[str, Any], spec: SampleSpec) -> Conditioning:
    """The seeded FL2VA request of ``spec`` laid out by diffusers' ``build_packed_sequence`` (module docstring)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    validate_spec(config, spec)
    patch = tuple(config.get("patch_size", (1, 2, 2)))
    position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond_video, n_cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((spec.text_length,), TEXT_TAG, dtype=torch.long), spec.latent_frames, spec.latent_height,
            spec.latent_width, spec.audio_latents, patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, KEYFRAME_ANCHORS,
        )
    )
    width = int(config["in_channels"]) * patch[0] * patch[1] * patch[2]
    generator = torch.Generator().manual_seed(spec.seed)
    keyframes = torch.randn(n_cond_video, width, generator=generator)
    noise = torch.randn(n_cond_video, width, generator=generator)
    # The anchors are held just short of clean, as the released model was trained (keyframe_noise_aug).
    condition = MiniMaxH3Scheduler(shift=VIDEO_SHIFT).scale_noise(keyframes, KEYFRAME_TIMESTEP, noise)
    generated = torch.randn(video_idx.numel() - n_cond_video, width, generator=generator)
    audio = torch.randn(audio_idx.numel(), int(config["audio_in_channels"]), generator=generator)
    prompt = torch.randn(1, spec.text_length, int(config["text_dim"]), generator=generator)
    layout = {"token_tags": token_tags, "position_ids": position_ids, "video_indices": video_idx.long(),
              "audio_indices": audio_idx.long(), "text_indices": text_idx.long()}
    return Conditioning(torch.cat([condition, generated]), audio, prompt, layout, int(n_cond_video), int(n_cond_audio))


@dataclass
class Trajectory:
    """What one trajectory produced: the compared tensors and the byte digest of every event, in order."""

    tensors: dict[str, torch.Tensor]  # name -> float32 CPU tensor (module docstring)
    events: list[tuple[int, str, str]]  # (step, tensor, sha256 of its bytes): model outputs and Euler updates
    wall_s: float = 0.0


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def schedules(num_steps: int, device: str | torch.device) -> tuple[Any, Any]:
    """The video (shift 12) and audio (shift 3) schedulers after ``set_timesteps(num_steps)``."""
    from diffusers import MiniMaxH3Scheduler

    video, audio = MiniMaxH3Scheduler(shift=VIDEO_SHIFT), MiniMaxH3Scheduler(shift=AUDIO_SHIFT)
    video.set_timesteps(num_steps, device=device)
    audio.set_timesteps(num_steps, device=device)
    if video.timesteps.numel() != audio.timesteps.numel():
        raise GenerateError(f"num_steps={num_steps}: the video schedule has {video.timesteps.numel()} steps after "
                            f"deduplication, the audio one {audio.timesteps.numel()}; choose another step count")
    return video, audio


@torch.no_grad()
def run_trajectory(model: torch.nn.Module, cond: Conditioning, num_steps: int, device: str | torch.device,
                   progress: Callable[[int, int], None] | None = None) -> Trajectory:
    """One full sampling trajectory, exactly as diffusers' denoise loop runs it (module docstring)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    started = time.perf_counter()
    scheduler, audio_scheduler = schedules(num_steps, device)
    ncv, nca = cond.num_condition_video_rows, cond.num_condition_audio_rows
    layout = {k: v.to(device) for k, v in cond.layout.items()}
    latents, audio = cond.video.to(device).clone(), cond.audio.to(device).clone()
    prompt = cond.prompt_embeds.to(device)
    out = Trajectory({}, [])
    n = scheduler.timesteps.numel()
    for i, (t, audio_t) in enumerate(zip(scheduler.timesteps, audio_scheduler.timesteps, strict=True)):
        unique, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            cond.layout["video_indices"], cond.layout["audio_indices"], ncv, nca, cond.layout["text_indices"].numel(),
            float(t), float(audio_t), max(float(t), KEYFRAME_TIMESTEP), CONDITION_AUDIO_TIMESTEP)
        noise_pred, audio_noise_pred = model(
            hidden_states=latents[None], audio_hidden_states=audio[None], encoder_hidden_states=prompt,
            timestep=unique.to(device), timestep_indices=indices.to(device), return_dict=False, **layout)
        out.events += [(i, "model_output/sample", _sha(noise_pred)), (i, "model_output/audio_sample",
                                                                        _sha(audio_noise_pred))]
        velocity, audio_velocity = noise_pred[0, ncv:].float(), audio_noise_pred[0, nca:].float()
        out.tensors[f"step{i}/video_velocity"] = velocity.cpu()
        out.tensors[f"step{i}/audio_velocity"] = audio_velocity.cpu()
        latents[ncv:] = scheduler.step(velocity, t, latents[ncv:], return_dict=False)[0]
        audio[nca:] = audio_scheduler.step(audio_velocity, audio_scheduler.timesteps[i], audio[nca:],
                                           return_dict=False)[0]
        out.events += [(i, "video_latents", _sha(latents)), (i, "audio_latents", _sha(audio))]
        if progress is not None:
            progress(i + 1, n)
    out.tensors["final/video_latents"] = latents[ncv:].float().cpu()
    out.tensors["final/audio_latents"] = audio[nca:].float().cpu()
    out.wall_s = time.perf_counter() - started
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


def tensor_order(names: Collection[str]) -> dict[str, int]:
    """Execution order: step i video 2i, audio 2i + 1, then the final latents."""
    steps = sorted({int(n.split("/")[0][4:]) for n in names if n.startswith("step")})
    order = {f"step{i}/{kind}": 2 * i + j for i in steps for j, kind in enumerate(("video_velocity", "audio_velocity"))}
    order.update({name: 2 * len(steps) + j for j, name in enumerate(FINAL_TENSORS)})
    return {n: order[n] for n in names}


def compare_trajectory(candidate: Trajectory, reference: Trajectory) -> dict[str, TensorComparison]:
    """Per-tensor metrics of a trajectory against the reference trajectory (float64, compare.py)."""
    return {name: compare_tensors(name, candidate.tensors[name], ref) for name, ref in reference.tensors.items()}


def final_metrics(candidate: Trajectory, reference: Trajectory) -> dict[str, dict[str, Any]]:
    """relative L2, max abs, PSNR (dB; peak = max(ref) - min(ref)) and cosine similarity of the final latents."""
    out: dict[str, dict[str, Any]] = {}
    for name in FINAL_TENSORS:
        c, r = candidate.tensors[name].double(), reference.tensors[name].double()
        cmp = compare_tensors(name, candidate.tensors[name], reference.tensors[name])
        mse = float(((c - r) ** 2).mean())
        peak = float(r.max() - r.min())
        psnr = math.inf if mse == 0 else (10 * math.log10(peak**2 / mse) if math.isfinite(mse) else -math.inf)
        denom = float(c.norm() * r.norm())
        cosine = float((c * r).sum()) / denom if denom > 0 else math.nan
        out[name] = {"relative_l2": json_float(cmp.relative_l2), "max_abs": json_float(cmp.max_abs),
                     "psnr_db": json_float(psnr), "cosine": json_float(cosine)}
    return out


def determinism(first: Trajectory, second: Trajectory) -> dict[str, Any]:
    """Byte equality of two trajectories event by event; the first mismatch as (step, tensor)."""
    for (step, name, sha_a), (_, _, sha_b) in zip(first.events, second.events, strict=True):
        if sha_a != sha_b:
            return {"deterministic": False, "events": len(first.events), "first_mismatch": {"step": step,
                                                                                           "tensor": name}}
    return {"deterministic": True, "events": len(first.events), "first_mismatch": None}


# -- the numerical gate's verdict ----------------------------------------------------------------


def candidate_identity(config: Mapping[str, Any], nodes: Collection[str] | None = None) -> dict[str, Any]:
    """``Binding.describe()`` of the strictly bound candidate (no overrides), on a meta-device model."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3kernels import ALL_NODES, bind

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    binding = bind(model, tuple(nodes) if nodes else ALL_NODES, strict=True)
    try:
        return binding.describe()
    finally:
        binding.unbind()


def require_passing_verdict(store: Store, reference: ReferenceInfo, candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The pointer to the passing numerical verdict of this candidate; ``MissingVerdict`` naming it otherwise."""
    key = passing_verdict_key(reference.preset, reference.device_type, reference.checkpoint_sha, candidate)
    pointer = store.read_ref(PASSING_VERDICTS, key)
    if pointer is None:
        raise MissingVerdict(
            f"no passing numerical verdict refs/{PASSING_VERDICTS}/{key}.json for preset {reference.preset} on "
            f"{reference.device_type}, checkpoint {reference.checkpoint_sha[:12]} and candidate sources "
            f"{str(candidate.get('h3kernels_sha256'))[:12]}: run `h3gate gate --preset {reference.preset} "
            f"--device {reference.device_type}` first (the generation gate starts only after it passed)")
    verdict = store.get_json(pointer["verdict_sha"], name=f"{pointer['gate_id']}/verdict.json")
    if verdict.get("passed") is not True or verdict.get("gate_id") != pointer["gate_id"]:
        raise MissingVerdict(f"refs/{PASSING_VERDICTS}/{key}.json points at {pointer['gate_id']}, whose "
                             "verdict.json is not a pass: rerun `h3gate gate`")
    return dict(pointer)


# -- the gate ------------------------------------------------------------------------------------


@dataclass
class GenerateOutcome:
    """The generation gate's result: ``doc`` is generate.json; ``provider_errors`` feeds the report."""

    generate_id: str
    doc: dict[str, Any]
    provider_errors: dict[str, dict[str, float]]
    rule: dict[str, Any]
    verdict: dict[str, Any] = field(default_factory=dict)


def _bound_trajectories(model: torch.nn.Module, cond: Conditioning, num_steps: int, device: str,
                        provider_name: str, nodes: Collection[str] | None,
                        overrides: Mapping[tuple[str, str], Callable[..., Any]] | None
                        ) -> tuple[Trajectory, Trajectory, dict[str, Any], list[str]]:
    """The candidate's trajectory twice (determinism); its describe() and the bound nodes that never ran."""
    from h3kernels import ALL_NODES, bind

    binding = bind(model, tuple(nodes) if nodes else ALL_NODES, strict=True, overrides=overrides)
    try:
        with activate(resolve_provider(provider_name, device), device):
            first = run_trajectory(model, cond, num_steps, device)
            second = run_trajectory(model, cond, num_steps, device)
    finally:
        binding.unbind()
    never = [f"{b}/{n}" for b, nodes_ in binding.ledger.items() for n, e in nodes_.items() if not e["forward"]]
    return first, second, binding.describe(), never


def provider_trajectory(store: Store, checkpoint: CheckpointRef, preset: Preset, num_steps: int, device: str,
                        provider: Provider) -> Trajectory:
    """One BF16 trajectory of the reference model under ``provider``, from the stored checkpoint (the work a
    provider's own process does: tasks/provider_process.py)."""
    model = load_model(store, checkpoint, DTYPES[CANDIDATE_DTYPE], device)
    with activate(provider, device):
        return run_trajectory(model, build_conditioning(preset.config, preset.sample), num_steps, device)


def _trajectory_in_own_process(store: Store, checkpoint: CheckpointRef, preset: Preset, num_steps: int, device: str,
                               provider: Provider) -> Trajectory:
    request = {"store": store_request(store), "checkpoint": asdict(checkpoint),
               "preset": preset.to_json(), "num_steps": num_steps, "device": device}
    result = run_in_own_process(provider, "trajectory", request)
    tensors = {name: result["tensors"][name] for name in result["tensor_names"]}
    return Trajectory(tensors, [tuple(e) for e in result["events"]], result["wall_s"])


def run_generate(store: Store, reference: ReferenceInfo, preset: Preset, checkpoint: CheckpointRef, *, device: str,
                 num_steps: int = 30, nodes: Collection[str] | None = None,
                 overrides: Mapping[tuple[str, str], Callable[..., Any]] | None = None,
                 progress: Callable[[str], None] | None = None) -> GenerateOutcome:
    """The generation gate of the candidate (module docstring); refuses without a passing numerical verdict."""
    note = progress or (lambda _msg: None)
    if checkpoint.sha256 != reference.checkpoint_sha:
        raise GenerateError(f"checkpoint {checkpoint.sha256[:12]} is not the reference's "
                            f"({reference.checkpoint_sha[:12]}): pass the checkpoint the numerical gate judged")
    pointer = require_passing_verdict(store, reference, candidate_identity(preset.config, nodes))
    schedules(num_steps, "cpu")  # reject a step count diffusers would not run before any model loads
    cond = build_conditioning(preset.config, preset.sample)

    model = load_model(store, checkpoint, torch.float32, device)
    with activate(fp32_provider(device), device):
        fp32 = run_trajectory(model, cond, num_steps, device)
    with activate(fp32_alt_provider(device), device):
        alt = run_trajectory(model, cond, num_steps, device)
    del model
    note(f"fp32 trajectory: {len(fp32.tensors)} tensors in {fp32.wall_s:.1f} s")
    model = load_model(store, checkpoint, DTYPES[CANDIDATE_DTYPE], device)
    providers: dict[str, Trajectory] = {}
    for name in sorted(reference.provider_runs):
        provider = resolve_provider(name, device)
        if needs_own_process(provider):
            providers[name] = _trajectory_in_own_process(store, checkpoint, preset, num_steps, device, provider)
        else:
            with activate(provider, device):
                providers[name] = run_trajectory(model, cond, num_steps, device)
        note(f"provider {name}: {providers[name].wall_s:.1f} s")
    cand, again, candidate, never_ran = _bound_trajectories(model, cond, num_steps, device,
                                                            reference.default_provider, nodes, overrides)
    note(f"candidate: 2 trajectories, {cand.wall_s:.1f} s each")
    del model

    # Rule on provider data only; the candidate judged against it
    errors = {p: {t: c.relative_l2 for t, c in compare_trajectory(tr, fp32).items()} for p, tr in providers.items()}
    noise = {t: c.relative_l2 for t, c in compare_trajectory(alt, fp32).items()}
    order = tensor_order(fp32.tensors)
    rule = rules.calibrate(errors, rules.derive_floor(noise), reference_manifest_sha=_trajectory_sha(fp32),
                           floor_method=rules.floor_method(noise))
    comparisons = compare_trajectory(cand, fp32)
    verdict = rules.verdict(comparisons, rule, order, ledger_missing=never_ran)
    det = determinism(cand, again)

    return _outcome(reference, pointer, preset, cond, num_steps, device, candidate, verdict, det, rule, errors,
                    comparisons, final_metrics(cand, fp32), {p: final_metrics(tr, fp32) for p, tr in providers.items()},
                    {"fp32": fp32.wall_s, "candidate": cand.wall_s, **{p: t.wall_s for p, t in providers.items()}})


def _trajectory_sha(trajectory: Trajectory) -> str:
    """The FP32 trajectory's identity: sha256 over its event digests (stands in for a reference manifest)."""
    return hashlib.sha256(json.dumps(trajectory.events).encode()).hexdigest()


def _step_rows(verdict: rules.Verdict, errors: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for t in verdict.tensors:
        if not t.name.startswith("step"):
            continue
        step, kind = t.name.split("/")
        row = rows.setdefault(int(step[4:]), {"step": int(step[4:])})
        prefix = kind.split("_")[0]
        row[f"{prefix}_error"] = json_float(t.relative_l2)
        row[f"{prefix}_bound"] = json_float(t.bound)
        row[f"{prefix}_ratio"] = json_float(t.ratio)
        row[f"{prefix}_providers"] = {p: json_float(e[t.name]) for p, e in sorted(errors.items())}
    return [rows[i] for i in sorted(rows)]


def _outcome(reference: ReferenceInfo, pointer: Mapping[str, Any], preset: Preset, cond: Conditioning,
             num_steps: int, device: str, candidate: Mapping[str, Any], verdict: rules.Verdict,
             det: Mapping[str, Any], rule: rules.EnsembleRule, errors: dict[str, dict[str, float]],
             comparisons: Mapping[str, TensorComparison], final: dict, provider_final: dict,
             wall_s: dict[str, float]) -> GenerateOutcome:
    step_tensors = [t for t in verdict.tensors if t.name.startswith("step")]
    worst = max(step_tensors, key=lambda t: t.ratio) if step_tensors else None
    failures = [t for t in verdict.failures]
    identity = {"steps": num_steps, "conditioning": cond.sha256(), "candidate": dict(candidate),
                "providers": sorted(errors)}
    gid = f"{pointer['gate_id']}-generate-{hashlib.sha256(canonical_json(identity).encode()).hexdigest()[:12]}"
    passed = verdict.passed and bool(det["deterministic"])
    doc = json.loads(canonical_json({
        "schema": GENERATE_SCHEMA, "generate_id": gid, "gate_id": pointer["gate_id"],
        "numerical_verdict_sha": pointer["verdict_sha"], "reference_id": reference.reference_id,
        "preset": preset.name, "device_type": reference.device_type, "device": device,
        "checkpoint": reference.checkpoint_sha, "conditioning": cond.sha256(), "num_steps": num_steps,
        "model_evaluations": len(step_tensors) // 2, "passed": passed, "numerically_passed": verdict.passed,
        "failures": failures, "first_failure": failures[0] if failures else None,
        "first_failing_step": next((int(f.split("/")[0][4:]) for f in failures if f.startswith("step")), None),
        "worst_step": None if worst is None else {"tensor": worst.name, "ratio": worst.ratio,
                                                  "relative_l2": worst.relative_l2, "bound": worst.bound},
        "final": final, "provider_final": provider_final, "determinism": dict(det),
        "ledger_never_ran": list(verdict.ledger_missing), "steps": _step_rows(verdict, errors),
        "rule": {"k": rule.k, "k_raw": rule.k_raw, "floor": rule.floor, "floor_method": rule.floor_method,
                 "leave_one_out": {p: dict(v) for p, v in rule.leave_one_out.items()}},
        "candidate": dict(candidate), "overrides": list(candidate.get("overrides", [])), "wall_s": wall_s,
        "comparisons": {n: c.to_dict() for n, c in comparisons.items()},
    }))
    return GenerateOutcome(gid, doc, errors, rule.to_dict(), verdict.to_dict())


def write_generate_document(store: Store, outcome: GenerateOutcome) -> str:
    """runs/<generate_id>/generate.json; returns its sha256."""
    return store.write_document(outcome.generate_id, GENERATE_FILE, outcome.doc).sha256
