"""Shared test configuration: hypothesis profiles and backend fixtures."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI is the landing gate, so its examples are fixed (derandomize): a red run must be
# reproducible from the commit alone. Exploration happens in "dev" runs (random,
# more examples), whose finds are pinned with @example.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=150, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
