"""Kernel tests run on the CPU through Triton's interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton decorates any kernel (it picks interpreter or compiler then), so it is
set here, before any test module imports h3kernels. With CUDA present the kernels compile for the GPU as usual.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
