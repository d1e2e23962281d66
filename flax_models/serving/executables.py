"""Compiled step programs kept on disk, so that a later process skips tracing, lowering
and compiling them.

JAX's persistent compilation cache skips XLA's compile, but finding an entry takes the
program's lowered module, so every start still traces and lowers each step program (a
Bamba-9B engine's 35 buckets: 108 s on an H200, 2026-12-02). This cache keeps each
executable itself (``jax.experimental.serialize_executable``) under a key computed
without tracing: everything the step program is a function of.

* The library's code: every ``.py`` file of ``flax_models`` and ``pallas_kernels``.
* JAX's, jaxlib's and Flax's versions, the backend's platform and version, the devices' kinds and
  ids, JAX's numerics flags (``jax_enable_x64``, ``jax_default_matmul_precision``) and
  ``XLA_FLAGS``.
* What the caller adds (:meth:`ExecutableCache.key`): for a step, the model's graph
  definition (its config, dtype, kernels and mesh), every argument's shape, dtype and
  sharding, the static arguments and XLA's options.

An entry that cannot be read or loaded is compiled afresh and written again; a cache
that cannot be written logs one warning and serves on without it. Loading an entry runs
what it holds, as JAX's own compilation cache does: the directory must be the user's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
from jax.experimental import serialize_executable

__all__ = ["ExecutableCache", "beside_compilation_cache", "canonical", "code_fingerprint"]

logger = logging.getLogger(__name__)

# The executables stored by this process, while alive: a later engine of the same process
# takes them as they are (XLA's CPU client cannot always run a program deserialized in the
# process that compiled it: "Function ... not found").
_STORED: weakref.WeakValueDictionary[str, jax.stages.Compiled] = weakref.WeakValueDictionary()

# Object addresses in reprs ("<function f at 0x7f...>"): they differ between processes.
_ADDRESS = re.compile(r"\s*(at )?0x[0-9a-fA-F]+")
_PACKAGES = ("flax_models", "pallas_kernels")
_SUFFIX = ".executable"


def beside_compilation_cache(compilation_cache_dir: str | os.PathLike) -> Path:
    """The executable cache's directory kept with JAX's compilation cache in
    ``compilation_cache_dir``: its ``executables`` folder (the server's, and the start-up
    benchmark's)."""
    return Path(compilation_cache_dir) / "executables"


@functools.cache
def code_fingerprint() -> str:
    """sha256 of every ``.py`` file of ``flax_models`` and ``pallas_kernels`` (path and
    contents): a changed line of the library makes every earlier entry unreachable."""
    digest = hashlib.sha256()
    for name in _PACKAGES:
        root = Path(__import__(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def canonical(value: Any) -> str:
    """``repr(value)`` without object addresses: the same text in every process for
    values whose repr shows their contents (configs, graph definitions, shardings)."""
    return _ADDRESS.sub("", repr(value))


def _environment() -> tuple[str, ...]:
    """What every entry depends on besides its program: versions, devices, flags."""
    client = jax.devices()[0].client
    devices = ",".join(f"{d.id}:{d.device_kind}" for d in jax.devices())
    return (
        code_fingerprint(),
        f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}",
        f"{client.platform} {client.platform_version}",
        devices,
        f"x64 {jax.config.jax_enable_x64} precision {jax.config.jax_default_matmul_precision}",
        os.environ.get("XLA_FLAGS", ""),
    )


class ExecutableCache:
    """Compiled programs on disk under ``directory`` (made if missing), one file a key."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._warned = False

    def key(self, *parts: Any) -> str:
        """The entry name of a program described by ``parts`` (with :func:`canonical`
        text), in this environment (the module docstring's list)."""
        digest = hashlib.sha256()
        for part in (*_environment(), *map(canonical, parts)):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def load(self, key: str, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The executable stored under ``key``, loaded onto ``devices`` (those it was
        compiled for, in its device assignment's order); None when there is none or it
        cannot be loaded (logged)."""
        path = self.path(key)
        compiled = _STORED.get(str(path))
        if compiled is not None:
            return compiled
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=list(devices)
            )
        except FileNotFoundError:
            return None
        except Exception as error:  # a truncated or foreign file: compile afresh
            logger.warning("executable cache: %s unreadable (%s); compiling afresh", path, error)
            return None

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Writes ``compiled`` under ``key`` (atomically: a reader never sees part of a
        file). Failures are logged once and otherwise ignored."""
        partial = None
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as out:
                partial = out.name
                out.write(blob)
            path = self.path(key)
            os.replace(partial, path)
            _STORED[str(path)] = compiled
        except Exception as error:
            if partial is not None:
                Path(partial).unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                logger.warning("executable cache: cannot write to %s: %s", self.directory, error)
