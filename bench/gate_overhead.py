"""Gate overhead: the gate's candidate run (every tensor compared as it is produced) vs a bare candidate
forward+backward of the same model, on a store that already holds the preset's reference and rule.

    python bench/gate_overhead.py STORE_URL [--preset block] [--device cuda] [--reps 3]

Bare: the strictly bound BF16 candidate, the same sample and upstream gradients, no hooks, no store
(its first pass, then the median of --reps warm ones). Gate run: ``tasks.gate.run_candidate``, timed as
it times itself: the hooked forward+backward comparing each tensor with its verified FP32 reference,
which was preloaded onto the device first when the memory plan has room (that preload is its own row)
or else streams from the store during the run. It runs twice: the first as a gate runs it (a freshly
loaded model), the second on a warm allocator. Where the rest goes: the hooked pass with every tensor
dropped (the capture's own cost), and every gated tensor compared alone (its reference vs that
reference rounded to BF16). Prints one table; the whole gate flow's wall time is measured by the caller
around ``h3gate gate``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h3kernels import ALL_NODES, bind
from tasks import gate
from tasks.calibration import NOT_GATED_KINDS
from tasks.capture import DTYPES, forward_backward, run_capture
from tasks.compare import compare_tensors
from tasks.model import get_preset, load_model, model_inputs, read_sample, write_synthetic_checkpoint
from tasks.providers import activate, resolve_provider
from tasks.reference import current_reference
from tasks.store import Store


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bare_forward_backward(model, sample, device: str, reps: int) -> list[float]:
    """Wall seconds of 1 + ``reps`` forward+backward passes (the first one cold), gradients dropped between."""
    times = []
    for _ in range(reps + 1):
        inputs = model_inputs(sample, device)
        _sync(device)
        started = time.perf_counter()
        forward_backward(model, inputs, sample)
        _sync(device)
        times.append(time.perf_counter() - started)
        del inputs
        model.zero_grad(set_to_none=True)
    return times


def hooked_forward_backward(model, sample, device: str, reps: int, granularity: str) -> list[float]:
    """Wall seconds of ``reps`` warm capture passes whose sink drops every tensor: what the hooks cost."""
    times = []
    for _ in range(reps):
        _sync(device)
        started = time.perf_counter()
        run_capture(model, sample, lambda *_: None, device=device, granularity=granularity)
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def compare_sweep(store: Store, records: dict, device: str) -> float:
    """Seconds of comparing every gated tensor alone: its FP32 reference (on the device) vs its BF16 rounding."""
    total = 0.0
    for name, record in records.items():
        if record["kind"] in NOT_GATED_KINDS:
            continue
        reference = store.get_tensor(record["sha256"], name=name, device=device)
        candidate = reference.to(DTYPES[gate.CANDIDATE_DTYPE]) if reference.is_floating_point() else reference
        _sync(device)
        started = time.perf_counter()
        compare_tensors(name, candidate, reference)
        _sync(device)
        total += time.perf_counter() - started
        del reference, candidate
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--preset", default="block")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    store = Store(args.store)
    preset = get_preset(args.preset)
    reference = current_reference(store, preset.name, torch.device(args.device).type)
    checkpoint = write_synthetic_checkpoint(store, preset)
    sample = read_sample(store, reference.sample_sha, preset.config)
    provider = resolve_provider(reference.default_provider, args.device)

    fp32_manifest = store.read_manifest(reference.fp32_run)
    model = load_model(store, checkpoint, DTYPES[gate.CANDIDATE_DTYPE], args.device)
    binding = bind(model, ALL_NODES, strict=True)
    try:
        with activate(provider, args.device):
            bare = bare_forward_backward(model, sample, args.device, args.reps)
            hooked = hooked_forward_backward(model, sample, args.device, args.reps,
                                             fp32_manifest["identity"]["granularity"])
    finally:
        binding.unbind()
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()

    first = gate.run_candidate(store, reference, preset, checkpoint, device=args.device)
    second = gate.run_candidate(store, reference, preset, checkpoint, device=args.device)
    with activate(provider, args.device):
        compare_s = compare_sweep(store, fp32_manifest["tensors"], args.device)
    bare_s = statistics.median(bare[1:])
    rows = [
        ("bare candidate fwd+bwd (first pass)", f"{bare[0]:.3f}"),
        ("bare candidate fwd+bwd (median, warm)", f"{bare_s:.3f}"),
        ("hooked fwd+bwd, tensors dropped (median)", f"{statistics.median(hooked):.3f}"),
        ("compare of every gated tensor alone", f"{compare_s:.3f}"),
        ("gate candidate run (capture + compare)", f"{first.wall_s:.3f}"),
        ("gate candidate run again (warm allocator)", f"{second.wall_s:.3f}"),
        ("ratio gate run / bare", f"{first.wall_s / bare_s:.2f}"),
        ("ratio gate run again / bare", f"{second.wall_s / bare_s:.2f}"),
        ("reference preload (before the run) seconds", f"{first.reference_load_s:.3f}"),
        ("reference preloaded on", first.reference_preloaded_on or "streamed"),
        ("gate run peak GiB", "-" if first.peak_device_bytes is None else f"{first.peak_device_bytes / 2**30:.2f}"),
        ("tensors compared", str(len(first.comparisons))),
    ]
    print(f"{'measure':<44} {'seconds':>9}")
    for label, value in rows:
        print(f"{label:<44} {value:>9}")


if __name__ == "__main__":
    main()
