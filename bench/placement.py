"""Split-placement identity and the memory planner against measured allocations (issue 10, one GPU).

For each dtype: the preset's model forward + backward captured unsplit, again unsplit (the
run-to-run baseline), and split into two block ranges on the same device through accelerate's
hooks; every captured tensor is hashed (sha256 of its bytes, nothing written to disk). Alongside,
the peak allocated bytes and the bytes autograd actually saved for backward are measured and set
against the plan's total and activations. Writes ``--out`` (JSON, the format tests/test_placement.py
reads) and prints a table last.

    python bench/placement.py --preset block --device cuda --out bench/results/block_memory.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time

import torch

from tasks.capture import DTYPES, PeakMemory, run_capture
from tasks.memory_plan import plan_memory
from tasks.model import build_sample, get_preset, load_model, write_synthetic_checkpoint
from tasks.placement import Placement
from tasks.providers import activate, device_name, fp32_provider, resolve_provider
from tasks.store import Store


def capture_hashes(model: torch.nn.Module, sample: dict, device: str, provider) -> tuple[dict, int, int | None, float]:
    """(name -> (order, sha256)), saved-for-backward bytes, peak allocated bytes, wall seconds of one capture."""
    hashes: dict[str, tuple[int, str]] = {}
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            saved[0] += storage.nbytes()
        return tensor

    def sink(name: str, kind: str, order: int, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        hashes[name] = (order, hashlib.sha256(data).hexdigest())

    started = time.perf_counter()
    with activate(provider, device), PeakMemory([device]) as memory, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_capture(model, sample, sink, device=device)
    return hashes, saved[0], memory.peak, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="block")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", default="float32:fp32,bfloat16:default",
                        help="dtype:provider pairs (CPU: cpu-default)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True): CUDA's index_select backward and some "
                             "attention backwards accumulate with atomics, so repeats differ without it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = str(torch.device(args.device if args.device != "cuda" else "cuda:0"))
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    preset = get_preset(args.preset)
    layers = preset.config["num_layers"]
    first = max(1, layers // 2)
    split = Placement.parse(f"{device}={first},{device}={layers - first}", layers)
    store = Store(tempfile.mkdtemp(prefix="h3-placement-"))
    checkpoint = write_synthetic_checkpoint(store, preset)
    sample = build_sample(preset.config, preset.sample)
    rows, results = [], {"machine": device_name(device), "preset": preset.name, "split": split.to_json(),
                         "deterministic": args.deterministic, "runs": []}
    for pair in args.runs.split(","):
        dtype, _, provider_name = pair.partition(":")
        provider = fp32_provider(device) if provider_name == "fp32" else resolve_provider(provider_name, device)
        plan = plan_memory(preset, dtype, Placement.single(device, layers), provider=provider)
        runs = {}
        for label, placement in (("unsplit", None), ("unsplit again", None), ("split", split)):
            model = load_model(store, checkpoint, DTYPES[dtype], device, placement)
            runs[label] = capture_hashes(model, sample, device, provider)
            del model
            torch.cuda.empty_cache()
        base, again, split_run = (runs[k][0] for k in ("unsplit", "unsplit again", "split"))
        differ_again = sorted(n for n in base if base[n] != again.get(n))
        differ_split = sorted(n for n in base if base[n] != split_run.get(n))
        _, saved, peak, wall = runs["unsplit"]
        total, activations = plan.devices[0].total, plan.devices[0].activations
        results["runs"].append({
            "dtype": dtype, "provider": provider.name, "tensors": len(base),
            "repeat_differs": differ_again[:5], "repeat_differs_count": len(differ_again),
            "split_differs": differ_split[:5], "split_differs_count": len(differ_split),
            "split_names_equal": sorted(base) == sorted(split_run),
            "peak_allocated": peak, "planned_total": total, "saved_bytes": saved,
            "planned_activations": activations, "split_peak_allocated": runs["split"][2],
            "wall_s": {k: round(v[3], 2) for k, v in runs.items()},
        })
        peak = peak or 0  # the CPU has no allocator statistics
        rows.append(f"{dtype + ' ' + provider.name:<18} {len(base):>7} {len(differ_again):>14} {len(differ_split):>13} "
                    f"{peak / 2**30:>9.2f} {total / 2**30:>9.2f} {total / max(peak, 1):>6.3f} "
                    f"{saved / 2**30:>9.2f} {activations / 2**30:>9.2f} {activations / saved:>6.3f}")
        with open(args.out, "w") as handle:  # after every run: a later failure keeps what was measured
            json.dump(results, handle, indent=2)
        print(rows[-1], flush=True)
    print(f"{preset.name} on {results['machine']}, split {split.describe()}")
    print(f"{'run':<18} {'tensors':>7} {'repeat-differ':>14} {'split-differ':>13} {'peak GiB':>9} {'plan GiB':>9} "
          f"{'ratio':>6} {'saved GiB':>9} {'plan act':>9} {'ratio':>6}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
