"""Shared pytest setup: hypothesis profile, GPU marker, implementation lists."""

from __future__ import annotations

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_enable_x64", False)

# Bounded, reproducible property tests: shapes come from small sampled_from sets so the
# number of compilations stays small.
settings.register_profile(
    "ci", max_examples=12, derandomize=True, database=None, deadline=None, print_blob=True
)
settings.register_profile(
    "gpu", max_examples=20, derandomize=True, database=None, deadline=None, print_blob=True
)
settings.load_profile("gpu" if jax.default_backend() == "gpu" else "ci")

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
