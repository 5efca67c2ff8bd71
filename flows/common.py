"""Parameters shared by every flow: where the store is, which preset, which device.

Flow parameters are pydantic models so the Prefect UI renders a form for reruns. Storage
credentials are never parameters: the store reads them from the worker's environment.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class StoreParams(BaseModel):
    """Where artifacts live and what the model is."""

    store: str | None = Field(
        None, description="Store URL (local folder, file://, s3://bucket/prefix). Default: $H3GATE_STORE or ./h3store"
    )
    preset: str = Field("tiny", description="Model preset: tiny, small, block or full")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Preset overrides: model config or sample fields, e.g. {num_layers: 4}"
    )
    device: str = Field("cpu", description="Torch device to run on: cpu, cuda, cuda:1 ...")
    split: str = Field(
        "", description="Split each model over devices: 'cuda:0,cuda:1' (even) or 'cuda:0=26,cuda:1=24' (blocks per "
        "device; repeat a device for two ranges on it). Empty: the whole model on `device`"
    )
    gpus_per_run: int = Field(
        1, ge=1, description="With device 'cuda' and no split: each model split evenly over this many GPUs; "
        "provider runs fan out, one per group of GPUs"
    )
    checkpoint: str | None = Field(
        None, description="Real checkpoint (diffusers folder or .safetensors files, path or URL); default synthetic"
    )
    capture: Literal["blocks", "nodes"] = Field(
        "blocks", description="Capture granularity: every block (default) or every node inside the blocks"
    )
