"""Shared pytest setup: fast CPU compiles, one compilation cache per run, hypothesis
profile, GPU marker."""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import pytest
from hypothesis import settings

from tests.helpers import FAST_COMPILE_FLAG

# The CPU suite is bound by XLA compiles of many small programs, most of whose time goes to
# LLVM optimisation: off, a compile takes about half as long and the tiny programs run a
# little slower. Set before JAX starts its backend (importing it starts none; the first
# device query below does); GPU runs are left as they are.
if os.environ.get("JAX_PLATFORMS") == "cpu" and FAST_COMPILE_FLAG not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()

jax.config.update("jax_enable_x64", False)

# One persistent compilation cache for the whole run (every xdist worker and the child
# processes tests start): tests build engines and models of the same shapes many times,
# and each new jit of the same program is a cache hit instead of a compile. The run's
# controller makes the directory before the workers start and removes it at the end.
_CACHE_ENV = "TESTS_JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        config.compilation_cache_dir = tempfile.mkdtemp(prefix="jax-compilation-cache-")
        os.environ[_CACHE_ENV] = config.compilation_cache_dir
        # Child processes (notebooks, multi-device scripts, the server) read these.
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.compilation_cache_dir
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """Frees every compiled program after each test module. Each loaded XLA CPU executable
    holds a few memory mappings, and a worker that compiled some ten thousand programs
    reached the kernel's limit on them (``vm.max_map_count``, 65530 by default): the next
    compile or cache write crashed the worker. Programs a later module needs again load
    from the run's persistent cache."""
    yield
    jax.clear_caches()


def pytest_unconfigure(config):
    directory = getattr(config, "compilation_cache_dir", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


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
