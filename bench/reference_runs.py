"""Print the runs of a store as a table: wall time, peak device memory, stored and new bytes.

    python bench/reference_runs.py STORE_URL [RUN_ID_SUBSTRING]

Reads only manifests (run metadata), so it can be pointed at any store after a reference.
"""

from __future__ import annotations

import sys

from tasks.store import Store


def main(url: str, match: str = "") -> None:
    store = Store.from_env(url)
    rows = []
    for run_id in store.list_runs():
        if match not in run_id:
            continue
        manifest = store.read_manifest(run_id)
        meta = manifest["metadata"]
        stored = sum(r["bytes"] for r in manifest["tensors"].values())
        peak = meta.get("peak_device_bytes")
        rows.append((run_id, len(manifest["tensors"]), meta.get("wall_s", 0.0),
                     None if peak is None else peak / 2**30, stored / 2**30, meta.get("device_name", "?")))
    print(f"{'run':<58} {'tensors':>7} {'wall s':>8} {'peak GiB':>9} {'stored GiB':>10}  device")
    for run_id, n, wall, peak, stored, device in rows:
        peak_text = "-" if peak is None else f"{peak:.2f}"
        print(f"{run_id:<58} {n:>7} {wall:>8.2f} {peak_text:>9} {stored:>10.3f}  {device}")


if __name__ == "__main__":
    main(*sys.argv[1:])
