"""h3kernels: the Triton candidate kernel set for the diffusers MiniMax-H3 transformer, and its model binding.

Public API (binding.py, nodes.py): `bind(model, nodes=ALL_NODES, *, strict=True, blocks=None, overrides=None,
observer=None) -> Binding`, `unbind(model)`, `Binding`, `NodeFallback`, and the node names `BLOCK_NODES`,
`REFINER_NODES`, `BOUNDARY_NODES`, `ALL_NODES`, `NODE_GROUPS`.

The names resolve lazily (PEP 562): `import h3kernels.reference` stays free of triton, and nothing here decides
before the caller does whether triton compiles or interprets (TRITON_INTERPRET is read when kernels are defined).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "bind": "binding", "unbind": "binding", "Binding": "binding", "NodeFallback": "binding",
    "ALL_NODES": "nodes", "BLOCK_NODES": "nodes", "REFINER_NODES": "nodes", "BOUNDARY_NODES": "nodes",
    "NODE_GROUPS": "nodes",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'h3kernels' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"h3kernels.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
