"""Whether qk_norm_rope's backward dx keeps its bytes across row tiles (QK_BWD_ROWS).

    python bench/qk_tile_bytes.py          # on CUDA; under TRITON_INTERPRET=1 every line says "same"

On CUDA the tile shape sets the layout, and with it the order of a row's sum over D; the interpreter sums a row in
one order at any tile. Prints one line per row tile against the 8-row tile (the GPU default). (Until session 22 it
also flipped a once-per-tile cos/sin read, since dropped from the kernel.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

import torch  # noqa: E402

from h3kernels import qk_norm_rope as qk_module  # noqa: E402

S, NH, D, RD = 37, 4, 32, 24  # odd rows: tiles of 4, 8 and 16 rows cross the s boundaries differently


def backward_dx(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    qk_module.qk_norm_rope(x, w, cos, sin, 1e-6).backward(dy)
    return x.grad


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(S, NH, D, generator=g).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device)
    angles = (30 * torch.randn(S, RD // 2, generator=g)).repeat(1, 2).to(device)
    cos, sin = angles.cos(), angles.sin()
    dx = {}
    for rows in (4, 8, 16):
        qk_module.QK_BWD_ROWS = rows
        dx[rows] = backward_dx(x, w, cos, sin, dy)
    base = dx[8]
    print(f"device {base.device}; against rows=8")
    for rows, value in dx.items():
        diff = (value - base).abs().max().item()
        print(f"rows={rows:2d}: {'same' if torch.equal(value, base) else 'differs'} (max|diff| {diff:.3e})")


if __name__ == "__main__":
    main()
