"""Gate overhead: the gate's candidate run (every tensor compared as it is produced) vs a bare candidate
forward+backward of the same model, on a store that already holds the preset's reference and rule.

    python bench/gate_overhead.py STORE_URL [--preset block] [--device cuda] [--reps 3]

Bare: the strictly bound BF16 candidate, the same sample and upstream gradients, no hooks, no store
(warm; median of --reps after one warm-up). Gate run: ``tasks.gate.run_candidate``, timed as it times
itself: the hooked forward+backward comparing each tensor with its verified FP32 reference, which was
preloaded onto the device first when the memory plan has room (that preload is its own row) or else
streams from the store during the run. Prints one table; the whole gate flow's wall time is measured by
the caller around ``h3gate gate``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h3kernels import ALL_NODES, bind
from tasks import gate
from tasks.capture import DTYPES, forward_backward
from tasks.model import get_preset, load_model, model_inputs, read_sample, write_synthetic_checkpoint
from tasks.providers import activate, resolve_provider
from tasks.reference import current_reference
from tasks.store import Store


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bare_forward_backward(model, sample, device: str, reps: int) -> list[float]:
    """Wall seconds of ``reps`` warm forward+backward passes (after one warm-up), gradients dropped between."""
    times = []
    for rep in range(reps + 1):
        inputs = model_inputs(sample, device)
        _sync(device)
        started = time.perf_counter()
        forward_backward(model, inputs, sample)
        _sync(device)
        if rep:
            times.append(time.perf_counter() - started)
        del inputs
        model.zero_grad(set_to_none=True)
    return times


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

    model = load_model(store, checkpoint, DTYPES[gate.CANDIDATE_DTYPE], args.device)
    binding = bind(model, ALL_NODES, strict=True)
    try:
        with activate(provider, args.device):
            bare = bare_forward_backward(model, sample, args.device, args.reps)
    finally:
        binding.unbind()
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()

    run = gate.run_candidate(store, reference, preset, checkpoint, device=args.device)
    bare_s = statistics.median(bare)
    print(f"{'measure':<44} {'seconds':>9}")
    print(f"{'bare candidate fwd+bwd (median, warm)':<44} {bare_s:>9.3f}")
    print(f"{'gate candidate run (capture + compare)':<44} {run.wall_s:>9.3f}")
    print(f"{'ratio gate run / bare':<44} {run.wall_s / bare_s:>9.2f}")
    print(f"{'reference preload (before the run) seconds':<44} {run.reference_load_s:>9.3f}")
    print(f"{'reference preloaded on':<44} {run.reference_preloaded_on or 'streamed':>9}")
    peak = run.peak_device_bytes
    print(f"{'gate run peak GiB':<44} {'-' if peak is None else f'{peak / 2**30:.2f}':>9}")
    print(f"{'tensors compared':<44} {len(run.comparisons):>9}")


if __name__ == "__main__":
    main()
