"""What the tests need to know about this host's CPU providers."""

from __future__ import annotations


def quick_cpu_providers() -> list[str]:
    """Three distinct BF16 providers of this host's CPU set: the ensemble of tests that need one, not all of it.

    The set depends on the host (tasks/providers.py): with oneDNN BF16 GEMMs oneDNN off is a provider; without them
    it would be a twin of the default, and ATen's scalar kernels are the third provider instead."""
    from tasks.providers import provider_set

    return list(provider_set("cpu"))[:3]
