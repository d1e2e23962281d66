"""Fully sharded data parallelism (FSDP, ZeRO-3 style) through JAX's SPMD partitioner.

On a mesh with an axis ``"fsdp"``, :func:`shard_fsdp` splits every parameter and every
optimizer-state array over it, along the largest axis that the array's current sharding
leaves whole and the fsdp size divides (a ``"tp"``-split kernel keeps its tp axis and
takes fsdp on another), and :func:`shard_batch` splits a batch's rows over it. The jitted
``train_step`` then runs data-parallel over fsdp: XLA all-gathers each weight where a
product needs it whole, reduce-scatters the gradients back onto the shards, and the
optimizer updates each device's shard only. Each device holds ``1 / fsdp`` of the
parameters, gradients and Adam moments. Loss and gradients are one device's (the loss is
a mean over the whole batch whichever device holds which rows).

Composable with ``"tp"``: build the model on a mesh with both axes (``HybridLM(cfg,
mesh=Mesh(devices.reshape(f, t), ("fsdp", "tp")))``); its tensor-parallel layers run as
before, their weights gathered over fsdp first. The same code runs on several hosts under
``jax.distributed.initialize()`` (one global mesh; each process passes its own rows to
``shard_batch`` as part of the global batch).

The Pallas kernels are custom calls XLA cannot partition: on the GPU a model on an
fsdp-only mesh runs its kernels on gathered (whole) operands; the matmuls, norms and the
loss are split. The CPU's ``"xla"`` implementation is partitioned everywhere.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"  # the mesh axis parameters, optimizer state and batch rows are split over


def fsdp_spec(spec: P, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> P:
    """``spec`` with ``"fsdp"`` added: on the largest axis of ``shape`` that ``spec`` leaves
    unsplit and the fsdp size divides (the first of equal ones), else beside the split of
    an axis that the product of its splits' sizes still divides (``("tp", "fsdp")``);
    unchanged when none can take it. ``axis_sizes``: the mesh's ``{name: size}``."""
    size = axis_sizes[FSDP]
    axes = list(spec) + [None] * (len(shape) - len(spec))

    def names(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    def split(a: int) -> int:
        return int(np.prod([axis_sizes[n] for n in names(axes[a])]))

    free = [a for a in range(len(shape)) if axes[a] is None and shape[a] % size == 0]
    shared = [
        a for a in range(len(shape)) if axes[a] is not None and shape[a] % (split(a) * size) == 0
    ]
    if size == 1 or not (free or shared):
        return P(*axes)
    if free:
        axes[max(free, key=lambda a: (shape[a], -a))] = FSDP
    else:
        a = max(shared, key=lambda a: (shape[a] // split(a), -a))
        axes[a] = (*names(axes[a]), FSDP)
    return P(*axes)


def _placed(array: jax.Array, mesh: Mesh) -> jax.Array:
    sharding = getattr(array, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    if FSDP in jax.tree.leaves(tuple(spec)):
        return array
    target = NamedSharding(mesh, fsdp_spec(spec, array.shape, dict(mesh.shape)))
    return jax.device_put(array, target)


def shard_fsdp(mesh: Mesh, *modules: Any) -> None:
    """Places every array of ``modules`` (a model, its ``nnx.Optimizer``) split over the
    mesh's ``"fsdp"`` axis, in place (:func:`fsdp_spec`; arrays already split over it are
    left). A model built on ``mesh`` (for its ``"tp"`` axis) keeps its tp splits."""
    if FSDP not in mesh.axis_names:
        raise ValueError(f"the mesh needs an axis named {FSDP!r}; it has {mesh.axis_names}")
    for module in modules:
        state = nnx.state(module)
        nnx.update(module, jax.tree.map(lambda a: _placed(a, mesh), state))


def shard_batch(mesh: Mesh, *arrays) -> tuple[jax.Array, ...]:
    """Batch arrays (``input_ids[B, L]``, ``labels[B, L]``) with their rows split over
    ``"fsdp"`` (B a multiple of its size), the rest replicated."""
    size = mesh.shape[FSDP]
    out = []
    for array in arrays:
        array = np.asarray(array)
        if array.shape[0] % size:
            raise ValueError(f"batch rows {array.shape[0]} must be a multiple of fsdp={size}")
        spec = P(FSDP, *([None] * (array.ndim - 1)))
        out.append(jax.device_put(array, NamedSharding(mesh, spec)))
    return tuple(out)
