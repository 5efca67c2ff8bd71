"""One MiniMax-H3 transformer block, forward + backward: diffusers' default BF16 provider vs the bound candidate.

    python bench/block.py                          # real widths (preset `block`), S = 4096 and 16384, on CUDA
    python bench/block.py --seqlens 16384 --json /tmp/block.json
    python bench/block.py --smoke                  # CPU, TRITON_INTERPRET=1, the `tiny` widths at S=96

The block is diffusers' own `MiniMaxH3TransformerBlock` built from the preset's widths (hidden 5376, 56 x 128, ffn
14336, time_embed 2688 for `block`), its weights drawn exactly as `tasks.model.synthetic_state_dict` draws block 0
of that preset (per-name seeded CPU generator, std 0.02, norm weights 1 + noise), kept in FP32 for the FP32 run and
rounded to BF16 for the other two. Inputs: the packed layout of `tasks.model.build_sample` (S = 16384 is the preset's
own sample; 4096 a smaller one of the same kind), so `adaln_indices` = timestep_indices * 3 + token_tags over T = 2
timesteps and cos/sin come from diffusers' `MiniMaxH3RotaryPosEmbed`; hidden states, temb and the output gradient
are seeded normals (hidden states BF16-rounded for the BF16 runs, temb FP32 as in the mixed-precision model).

Three runs per S, on the same inputs:
    fp32       the block in FP32 under `tasks.providers.fp32_provider` (TF32 off): the truth.
    default    the BF16 block under CUDA_PROVIDERS["default"] (native SDPA, cuBLAS): what diffusers runs.
    candidate  the same BF16 block bound with `h3kernels.bind(block_wrapper(block), strict=True)`, under the same
               provider (its GEMMs are the same cuBLAS calls); `missing()` must be empty after the backward.
Timing (default and candidate): per iteration, parameter and input grads set to None (host side), then CUDA events
around forward and forward + backward (`out.backward(grad)`); warmup 3, median of 10. Accuracy: relative L2
||run - fp32|| / ||fp32|| of the output, the hidden-states and temb gradients and the weight gradients of
adaln_proj (the gated quantity, target < 0.02), to_q, ff_out and norm1.
Targets: candidate time <= default (stretch 0.85x).
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on CPU tensors

import torch  # noqa: E402

# Timing discipline (the brief and METHOD.md): warm up, then the median of per-iteration CUDA event pairs.
WARMUP, ITERS = 3, 10
# GPU-side wait queued before each timed call (torch.cuda._sleep cycles, ~1 ms at the H200's clocks) so that the
# host's launch work for the call (autograd's engine, Triton's launcher, allocations) runs while the GPU waits
# outside the timed region. Without it a call whose launches take longer than its kernels timed the host: on the
# H200 (session 15) gated_residual's backward measured 0.18 ms in one process and 0.30-0.35 ms in others at the same
# constants.
LAUNCH_HEADSTART_CYCLES = 2_000_000
# Relative-L2 target of the adaln_proj weight gradient against FP32, and the time-ratio targets.
ADALN_GRAD_TARGET = 0.02
RATIO_TARGET, RATIO_STRETCH = 1.0, 0.85
# S -> packed-sample spec (tasks.model.SampleSpec fields). 16384 is the `block` preset's own sample (512 text,
# 2 x 960 keyframe, 2 x 736 audio, 13 x 960 video rows); 4096 = 256 text + 2 x 256 keyframe + 2 x 256 audio +
# 11 x 256 video rows; 96 is the `tiny` preset's sample (smoke).
SAMPLE_SPECS: dict[int, dict[str, int]] = {
    16384: dict(latent_frames=13, latent_height=48, latent_width=80, audio_latents=736, text_length=512),
    4096: dict(latent_frames=11, latent_height=32, latent_width=32, audio_latents=256, text_length=256),
    96: dict(latent_frames=3, latent_height=8, latent_width=8, audio_latents=5, text_length=6),
}
# Gradients compared against FP32: label -> parameter name in the block.
WEIGHT_GRADS = {
    "dW adaln_proj": "adaln_proj.linear.weight",
    "dW to_q": "attn.to_q.weight",
    "dW ff_out": "ff.net.2.weight",
    "dW norm1": "norm1.weight",
}


# ------------------------------------------------------------------------------------------------ shared helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = WARMUP, iters: int = ITERS,
            flush: torch.Tensor | None = None) -> float:
    """Median ms of `fn` over `iters` runs after `warmup`: CUDA event pairs on the GPU (`flush`, if given, is zeroed
    before each start event, outside the timed region, to evict L2; then a LAUNCH_HEADSTART_CYCLES wait, so the
    events time the GPU's work, not the host's launches), the host clock on the CPU (smoke only)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(LAUNCH_HEADSTART_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel_l2(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either is missing; inf if a has NaN/Inf)."""
    if a is None or b is None:
        return float("nan")
    a64, b64 = a.detach().double(), b.detach().double()
    if not torch.isfinite(a64).all():
        return float("inf")
    return float(torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64).clamp_min(1e-300))


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain left-aligned text table."""
    cells = [list(header), *[list(map(str, r)) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Versions, the device, and the attention override in force ($H3KERNELS_ATTN_CONFIG: a sweep's block runs differ
    only there, so a log or JSON without it could not say which attention it timed)."""
    import triton

    from h3kernels.attention import CONFIG_ENV

    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:
        diffusers_version = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    return {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "diffusers": diffusers_version,
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"), "attn_config": os.environ.get(CONFIG_ENV, "")}


def machine_line(info: dict[str, Any], *notes: str) -> str:
    """machine()'s facts as a benchmark log's first line, then `notes` (empty ones left out)."""
    parts = [info["device"], f"torch {info['torch']}", f"triton {info['triton']}", f"diffusers {info['diffusers']}"]
    if info["attn_config"]:
        parts.append(f"attention {info['attn_config']}")
    return " | ".join(parts + [n for n in notes if n])


# ------------------------------------------------------------------------------------------------ block and inputs


def block_config(preset: str) -> dict[str, Any]:
    from tasks.model import get_preset

    return dict(get_preset(preset, {"num_layers": 1, "num_refiner_layers": 1}).config)


def build_block(config: dict[str, Any], weight_seed: int = 0) -> torch.nn.Module:
    """diffusers' MiniMaxH3TransformerBlock in FP32 on the CPU, weights as synthetic_state_dict draws block 0."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    from tasks.model import SYNTHETIC_STD

    block = MiniMaxH3TransformerBlock(
        hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
        attention_head_dim=config["attention_head_dim"], ffn_dim=config["ffn_dim"],
        time_embed_dim=config["time_embed_dim"], norm_eps=config.get("norm_eps", 1e-5),
        qk_norm_eps=config.get("qk_norm_eps", 1e-5))
    with torch.no_grad():
        for name, param in block.named_parameters():
            # The rule of tasks.model.synthetic_state_dict, for the name block 0 has in the model.
            full = f"transformer_blocks.0.{name}"
            digest = hashlib.sha256(f"{weight_seed}:{full}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * SYNTHETIC_STD
            if "norm" in full.split(".")[-2] and full.endswith("weight"):
                values = values + 1.0
            param.copy_(values)
    return block


_LAYOUTS: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}


def layout(preset: str, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(adaln_indices [S] long, cos [S, RD] fp32, sin, T) of the packed sample with S rows, on the CPU."""
    if (preset, S) not in _LAYOUTS:
        from diffusers.models.transformers.transformer_minimax_h3 import (
            MINIMAX_H3_MODALITY_NUM,
            MiniMaxH3RotaryPosEmbed,
        )

        from tasks.model import SampleSpec, build_sample

        if S not in SAMPLE_SPECS:
            raise ValueError(f"no packed-sample spec for S={S}; known: {sorted(SAMPLE_SPECS)}")
        config = dict(block_config(preset))
        sample = build_sample(config, SampleSpec(**SAMPLE_SPECS[S]))
        if sample["position_ids"].shape[0] != S:
            raise ValueError(f"the spec for S={S} builds {sample['position_ids'].shape[0]} rows")
        idx = sample["timestep_indices"] * MINIMAX_H3_MODALITY_NUM + sample["token_tags"]
        rope = MiniMaxH3RotaryPosEmbed(rope_freq_dim=config["rope_freq_dim"], rope_theta=config.get("rope_theta", 1e4))
        cos, sin = rope(sample["position_ids"])
        _LAYOUTS[(preset, S)] = (idx.long(), cos.float().contiguous(), sin.float().contiguous(),
                                 sample["timestep"].numel())
    return _LAYOUTS[(preset, S)]


def block_inputs(preset: str, S: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    config = block_config(preset)
    idx, cos, sin, T = layout(preset, S)
    g = torch.Generator().manual_seed(seed)
    H, E = config["hidden_size"], config["time_embed_dim"]
    return {
        "hidden_states": torch.randn(1, S, H, generator=g).to(device),
        "temb": torch.randn(T, E, generator=g).to(device),
        "adaln_indices": idx.to(device),
        "rotary_emb": (cos.to(device), sin.to(device)),
        "grad": torch.randn(1, S, H, generator=g).to(device),
    }


def _leaves(inputs: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs["hidden_states"].to(dtype).detach().requires_grad_(True)
    temb = inputs["temb"].detach().clone().requires_grad_(True)  # temb stays FP32 (the time embedder's dtype)
    return x, temb


def run_once(block: torch.nn.Module, inputs: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Forward + backward once; the output and the compared gradients (detached, in their own dtype)."""
    block.zero_grad(set_to_none=True)
    x, temb = _leaves(inputs, dtype)
    out = block(x, temb, inputs["adaln_indices"], inputs["rotary_emb"])
    out.backward(inputs["grad"].to(out.dtype))
    params = dict(block.named_parameters())
    result = {"out": out.detach(), "d hidden_states": x.grad, "d temb": temb.grad}
    result.update({label: params[name].grad for label, name in WEIGHT_GRADS.items()})
    block.zero_grad(set_to_none=True)
    return result


def time_block(block: torch.nn.Module, inputs: dict[str, Any], dtype: torch.dtype, device: torch.device,
               warmup: int, iters: int) -> tuple[float, float]:
    """Median (forward ms, forward + backward ms) over `iters` after `warmup`."""
    grad = inputs["grad"].to(dtype)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        block.zero_grad(set_to_none=True)
        x, temb = _leaves(inputs, dtype)
        return x, temb

    def once(marks: list[Any] | None) -> None:
        x, temb = step()
        if marks:
            marks[0].record()
        out = block(x, temb, inputs["adaln_indices"], inputs["rotary_emb"])
        if marks:
            marks[1].record()
        out.backward(grad)
        if marks:
            marks[2].record()

    for _ in range(warmup):
        once(None)
    sync(device)
    if device.type != "cuda":
        fwd, tot = [], []
        for _ in range(iters):
            x, temb = step()
            t0 = time.perf_counter()
            out = block(x, temb, inputs["adaln_indices"], inputs["rotary_emb"])
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            fwd.append((t1 - t0) * 1e3)
            tot.append((t2 - t0) * 1e3)
        block.zero_grad(set_to_none=True)
        return statistics.median(fwd), statistics.median(tot)
    all_marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for marks in all_marks:
        once(marks)
    torch.cuda.synchronize(device)
    block.zero_grad(set_to_none=True)
    return (statistics.median(m[0].elapsed_time(m[1]) for m in all_marks),
            statistics.median(m[0].elapsed_time(m[2]) for m in all_marks))


# ------------------------------------------------------------------------------------------------ the benchmark


def run(preset: str, seqlens: Sequence[int], device: torch.device, *, warmup: int = WARMUP, iters: int = ITERS,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the block, then per S: the FP32 truth, default and candidate (timed and compared). JSON-able dict."""
    from h3kernels import bind
    from tasks.golden import block_wrapper
    from tasks.providers import CPU_PROVIDERS, CUDA_PROVIDERS, activate, fp32_provider

    dev = str(device)
    default = CUDA_PROVIDERS["default"] if device.type == "cuda" else CPU_PROVIDERS["cpu-default"]
    config = block_config(preset)
    t0 = time.perf_counter()
    fp32_block = build_block(config).to(device)
    bf16_block = copy.deepcopy(fp32_block).to(torch.bfloat16)  # the same values, rounded once (a bf16 checkpoint)
    log(f"block: preset {preset} (hidden {config['hidden_size']}, {config['num_attention_heads']} x "
        f"{config['attention_head_dim']}, ffn {config['ffn_dim']}, time_embed {config['time_embed_dim']}), "
        f"weights built in {time.perf_counter() - t0:.1f} s")
    results: dict[str, Any] = {"preset": preset, "config": {k: config[k] for k in (
        "hidden_size", "num_attention_heads", "attention_head_dim", "ffn_dim", "time_embed_dim", "rope_freq_dim")},
        "provider": default.name, "warmup": warmup, "iters": iters, "per_seqlen": {}}
    for S in seqlens:
        entry: dict[str, Any] = {}
        results["per_seqlen"][str(S)] = entry
        try:
            inputs = block_inputs(preset, S, device)
            with activate(fp32_provider(dev), dev):
                truth = run_once(fp32_block, inputs, torch.float32)
            sync(device)
            for name in ("default", "candidate"):
                with activate(default, dev):
                    binding = bind(block_wrapper(bf16_block), strict=True) if name == "candidate" else None
                    try:
                        got = run_once(bf16_block, inputs, torch.bfloat16)
                        errors = {label: rel_l2(got[label], truth[label]) for label in truth}
                        del got
                        fwd_ms, total_ms = time_block(bf16_block, inputs, torch.bfloat16, device, warmup, iters)
                        run_info: dict[str, Any] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": total_ms, "rel_l2": errors}
                        if binding is not None:
                            run_info["missing"] = binding.missing()
                            run_info["fallbacks"] = {f"{b}/{n}": e["fallback"] for b, nodes in binding.ledger.items()
                                                     for n, e in nodes.items() if e["fallback"]}
                    finally:
                        if binding is not None:
                            binding.unbind()
                entry[name] = run_info
                log(f"block S={S} {name}: fwd {fwd_ms:.2f} ms, fwd+bwd {total_ms:.2f} ms, adaln dW rel-L2 "
                    f"{errors['dW adaln_proj']:.3e}")
                free(device)
            entry["ratio"] = entry["candidate"]["fwd_bwd_ms"] / entry["default"]["fwd_bwd_ms"]
        except Exception as err:  # noqa: BLE001 (one S failing must not lose the others' numbers)
            traceback.print_exc()
            entry["error"] = f"{type(err).__name__}: {err}"
            log(f"block S={S}: FAILED {entry['error']}")
        finally:
            truth = inputs = None  # noqa: F841 (free the FP32 grads before the next S)
            free(device)
    del fp32_block, bf16_block
    free(device)
    return results


def rows(results: dict[str, Any]) -> list[list[str]]:
    """Rows for the common table: [section, case, what, candidate, baseline, ratio / target]."""
    out = []
    for S, e in results["per_seqlen"].items():
        if "error" in e and "candidate" not in e:
            out.append(["block", f"S={S}", "-", "FAILED", e["error"][:80], ""])
            continue
        c, d = e["candidate"], e["default"]
        ratio = e["ratio"]
        verdict = (f"target <= {RATIO_TARGET:.2f}: {'ok' if ratio <= RATIO_TARGET else 'over'}, "
                   f"stretch <= {RATIO_STRETCH}: {'met' if ratio <= RATIO_STRETCH else 'not met'}")
        out.append(["block", f"S={S}", "fwd ms", f"{c['fwd_ms']:.2f}", f"default {d['fwd_ms']:.2f}",
                    f"{c['fwd_ms'] / d['fwd_ms']:.2f}x"])
        out.append(["block", f"S={S}", "fwd+bwd ms", f"{c['fwd_bwd_ms']:.2f}", f"default {d['fwd_bwd_ms']:.2f}",
                    f"{ratio:.2f}x ({verdict})"])
        for label in c["rel_l2"]:
            cv, dv = c["rel_l2"][label], d["rel_l2"][label]
            target = ""
            if label == "dW adaln_proj":
                target = f"target < {ADALN_GRAD_TARGET}: cand {'ok' if cv < ADALN_GRAD_TARGET else 'over'}, " \
                         f"default {'ok' if dv < ADALN_GRAD_TARGET else 'over'}"
            out.append(["block", f"S={S}", f"rel-L2 vs fp32 {label}", f"{cv:.3e}", f"default {dv:.3e}", target])
        if c.get("missing") or c.get("fallbacks"):
            out.append(["block", f"S={S}", "binding", f"missing {c.get('missing')}", f"fallbacks {c['fallbacks']}",
                        "candidate did not run fully"])
    return out


HEADER = ("section", "case", "what", "candidate", "baseline", "ratio / target")


def bench_device(smoke: bool, script: str) -> torch.device | None:
    """The CPU under --smoke, else CUDA; None, after saying so, where there is no CUDA device."""
    if not smoke and not torch.cuda.is_available():
        print(f"{script} needs a CUDA device (or --smoke); nothing measured.")
        return None
    return torch.device("cpu" if smoke else "cuda")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny widths, S=96")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 4096 16384 (smoke: 96)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    smoke = args.smoke
    device = bench_device(smoke, "bench/block.py")
    if device is None:
        return 0
    info = machine()
    print(machine_line(info, "SMOKE (CPU interpreter)" if smoke else ""), flush=True)
    results = run("tiny" if smoke else "block", args.seqlens or ([96] if smoke else [4096, 16384]), device,
                  warmup=args.warmup if args.warmup is not None else (1 if smoke else WARMUP),
                  iters=args.iters if args.iters is not None else (2 if smoke else ITERS),
                  log=lambda s: print(s, flush=True))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "block": results}, indent=1))
    print(table(rows(results), HEADER))
    return 1 if any("error" in e for e in results["per_seqlen"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
