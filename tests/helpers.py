"""Helpers shared by the tests: implementation lists, random ragged batches, poisoning."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import Op, backend_for, supports_mosaic
from pallas_kernels.testing import assert_close_per_row, assert_slots_untouched

REPO_ROOT = Path(__file__).resolve().parents[1]


def implementations(op: Op) -> list[str]:
    """Backends of an op this machine can run: Pallas Triton kernels run in interpret mode
    off-GPU; Mosaic GPU kernels need a Hopper GPU. A new backend added to an op is tested
    automatically."""
    return sorted(name for name in op.names if name != "mosaic" or supports_mosaic())


def tiled_implementations(op: Op) -> list[str]:
    """:func:`implementations` less ``mosaic``, for tests of tiny fp32 problems: the Mosaic
    GPU kernels take bf16/fp16 at real tile sizes only (attention: head dims 64/128;
    ``ssd_scan``: head dim 64, chunks of 128 or 256 rows), which their GPU real-size
    tests and the CPU lowering tests cover."""
    return [name for name in implementations(op) if name != "mosaic"]


def skip_if_mosaic_refuses(op: Callable, *args, **kwargs) -> None:
    """Skips the test, with the reason, when ``op(*args, **kwargs)`` names the ``mosaic``
    backend and that backend does not serve the call: the Mosaic GPU kernels take only
    some shapes and dtypes and raise on the others (nothing runs here)."""
    if kwargs.get("implementation") != "mosaic":
        return
    try:
        backend_for(op, *args, **kwargs)
    except ValueError as reason:
        pytest.skip(f"the Mosaic kernel does not serve this call: {reason}")


def query_start_loc(lengths: Sequence[int]) -> np.ndarray:
    """int32[B + 1] from per-sequence lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def dead_rows(num_tokens: int, query_start_loc, slot_ids) -> np.ndarray:
    """bool[T]: rows of padding sequences (slot -1) and rows past ``query_start_loc[-1]``,
    whose outputs must be exactly 0."""
    dead = np.ones(num_tokens, bool)
    for b, slot in enumerate(slot_ids):
        if slot >= 0:
            dead[query_start_loc[b] : query_start_loc[b + 1]] = False
    return dead


def normal(rng: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0) -> jnp.ndarray:
    """Random normal data (never zeros) cast to ``dtype``."""
    return jnp.asarray(rng.normal(size=shape) * scale, dtype=jnp.float32).astype(dtype)


def as_f32(a) -> np.ndarray:
    """A float32 NumPy copy of a JAX/NumPy array (bf16 values are exact in float32)."""
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def assert_bit_identical(actual, expected, name: str) -> None:
    """Same dtype, shape and bytes (NaN payloads included): nothing was written."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    assert actual.tobytes() == expected.tobytes(), f"{name} changed"


def poison_slots(cache, keep) -> jax.Array:
    """A copy of ``cache[S, ...]`` (same dtype) with every slot not in ``keep`` NaN: a kernel
    that reads a slot it must not shows NaN, one that writes it breaks bit-identity."""
    cache = jnp.asarray(cache)
    keep = {int(s) for s in np.asarray(keep).reshape(-1) if 0 <= s < cache.shape[0]}
    poisoned = np.array([s not in keep for s in range(cache.shape[0])])
    shape = (-1,) + (1,) * (cache.ndim - 1)
    return jnp.where(jnp.asarray(poisoned).reshape(shape), jnp.nan, cache).astype(cache.dtype)


def check_slot_cache(new_cache, old_cache, expected, touched, *, rtol: float, name: str) -> None:
    """A slot-indexed cache after an op: each slot in ``touched`` (ids outside ``[0, S)``
    ignored) within ``rtol`` of ``expected`` on its own, every other slot bit-identical to
    ``old_cache``."""
    num_slots = np.asarray(old_cache).shape[0]
    rows = sorted({int(s) for s in np.asarray(touched).reshape(-1) if 0 <= s < num_slots})
    assert_close_per_row(
        as_f32(new_cache)[rows], np.asarray(expected)[rows], rtol=rtol, name=f"{name} slots {rows}"
    )
    assert_slots_untouched(new_cache, old_cache, rows, name=name)


def out_of_range_slot_ids(num_slots: int) -> tuple[int, ...]:
    """Slot ids every op treats as padding (-1): past the cache and below -1, including ids
    that would wrap (-2 → S-2) or clamp (S+3 → S-1) onto a real slot."""
    return (num_slots, num_slots + 3, -2, -7)


def check_out_of_range_slots_are_padding(
    run: Callable[[np.ndarray], tuple[Sequence, Sequence]],
    slot_ids: Sequence[int],
    row: int,
    *,
    num_slots: int,
) -> tuple[Sequence, Sequence]:
    """``run(slot_ids) -> (outputs, caches)``: with ``slot_ids[row]`` replaced by each of
    :func:`out_of_range_slot_ids`, every output and cache is bit-identical to the run with
    ``slot_ids[row] = -1`` (so the row's outputs are the padding row's, other rows are
    unaffected, and nothing is read from or written to any slot for it). Returns the
    ``-1`` run's results for the caller's own checks (zero rows, untouched slots)."""
    padded = np.array(slot_ids, np.int32)
    padded[row] = -1
    outputs, caches = run(padded)
    for bad in out_of_range_slot_ids(num_slots):
        ids = padded.copy()
        ids[row] = bad
        bad_outputs, bad_caches = run(ids)
        for i, (got, want) in enumerate(zip(bad_outputs, outputs, strict=True)):
            assert_bit_identical(got, want, f"output {i} with slot id {bad}")
        for i, (got, want) in enumerate(zip(bad_caches, caches, strict=True)):
            assert_bit_identical(got, want, f"cache {i} with slot id {bad}")
    return outputs, caches


def poison_tail(cache: np.ndarray, slot_ids, lengths) -> np.ndarray:
    """A copy of ``cache[S, L, ...]`` with positions at or past ``lengths[b]`` of each named
    slot (and every unnamed slot) set to NaN: whatever reads them shows up."""
    cache = np.array(cache, dtype=np.float32, copy=True)
    named = np.zeros(cache.shape[0], bool)
    for slot, length in zip(slot_ids, lengths, strict=True):
        if slot >= 0:
            cache[slot, length:] = np.nan
            named[slot] = True
    cache[~named] = np.nan
    return cache


_H100 = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132
)


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of ``fn(*args)`` lowered for CUDA (``args`` are ShapeDtypeStructs).

    Runs on any machine, no GPU needed: it catches unsupported primitives and Triton's shape
    rules, which interpret mode does not enforce. ptxas does not run, so shared-memory
    overflow and spills show only on the GPU.
    """
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
    """Abstract argument for :func:`lower_for_cuda`."""
    return jax.ShapeDtypeStruct(shape, dtype)


# XLA's CPU backend spends most of a small program's compile time in LLVM optimisation; off,
# a compile takes about half as long and the (tiny) program runs a little slower.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def fast_compile_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for child processes that compile many small programs once each (the
    notebooks, benchmark smoke runs): on a CPU, with XLA's backend optimisation off; on a
    GPU unchanged (the GPU runs are the real ones)."""
    env = dict(environ)
    if jax.default_backend() == "cpu":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()
    return env


def cpu_devices_env(count: int) -> dict[str, str]:
    """This process's environment for a child process with ``count`` CPU devices (the XLA
    flag must be set before JAX starts, hence a subprocess)."""
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
    )


def run_python(
    code: str, *args: str, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``python -c code *args`` from the repository root, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def eqns_outside_kernels(jaxpr):
    """The equations of ``jaxpr`` and its sub-jaxprs, not looking inside pallas_calls."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns_outside_kernels(inner)


def primitives_outside_kernels(jaxpr) -> set[str]:
    """Primitive names of ``jaxpr`` and its sub-jaxprs, not looking inside pallas_calls:
    what a backward pass computes outside its kernels."""
    return {eqn.primitive.name for eqn in eqns_outside_kernels(jaxpr)}


def pallas_call_names(jaxpr) -> set[str]:
    """The names of the pallas_calls in ``jaxpr`` and its sub-jaxprs."""
    return set(pallas_call_counts(jaxpr))


def equations(jaxpr, primitive: str) -> list:
    """Every equation of ``primitive`` in ``jaxpr`` and its sub-jaxprs (pallas_call kernel
    bodies excluded)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += equations(inner, primitive)
    return found


def pallas_call_counts(jaxpr) -> collections.Counter:
    """How many pallas_calls of each name ``jaxpr`` and its sub-jaxprs hold."""
    return collections.Counter(
        str(eqn.params.get("name_and_src_info", eqn.params.get("name")))
        for eqn in equations(jaxpr, "pallas_call")
    )
