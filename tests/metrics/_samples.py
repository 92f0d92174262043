"""Reading one sample back from a registry."""

from __future__ import annotations

from typing import Any


def value(registry: Any, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` (it must exist)."""
    got = registry.get_sample_value(name, labels)
    assert got is not None, f"no sample {name}{labels}"
    return float(got)
