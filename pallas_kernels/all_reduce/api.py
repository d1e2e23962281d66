"""``all_reduce``: validation and dispatch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _validation as checks
from pallas_kernels.all_reduce import mosaic, reference
from pallas_kernels.backend import Backend, Call, Implementation, Op, backend_names

# Where a request naming ``mosaic`` among others takes the kernel: two devices of one
# process and 2-16 MiB a call (a 256-row decode step's 2 MiB; from 2026-11-28, when a
# model's auto began to ask for it, the lower bound is the measured 2 MiB, not 1 MiB: a
# Nemotron-H-56B-shaped 64-row step's 1 MiB stays on psum as it was measured). Measured in the
# Bamba-9B-shaped tp = 2 decode step at 256 rows: on two H200s (2026-11-27), alternated
# processes on one machine, 16.23 ms with the kernel's prototype against 16.91 / 16.75 ms
# with psum; on two H100s (2026-11-28), two engines of one model alternated in one process,
# 20.500 / 20.556 ms against psum's 20.854 / 20.846. At one row (8 KiB) the kernel loses
# (5.37 against 4.35 ms a step, two H200s): its launch (XLA's barrier and collective
# metadata, about 35 µs chained) costs more than NCCL's 19-25 µs. Above 16 MiB (prefill)
# NCCL's own kernels were not measured against it, and on more devices a one-shot read
# moves more bytes than a ring. Several processes (one GPU each) keep psum: the kernel has
# only run with one process driving every GPU.
#
# ``auto`` is psum: Mosaic's lowering takes only meshes whose device ids are row-major
# (``arange``), which the op, traced inside ``shard_map``, cannot see. The model's layers,
# which know their mesh, ask for the window (``flax_models.sharding.psum_tp``).
KERNEL_DEVICES: Final = 2
KERNEL_MIN_BYTES: Final = 2 << 20
KERNEL_MAX_BYTES: Final = 16 << 20


def _mosaic_supports(arrays: tuple, *, axis_name: str) -> str | None:
    del axis_name
    if any(x.size == 0 for x in arrays):
        return "arrays with no elements"
    return None


ALL_REDUCE = Op(
    "all_reduce",
    (
        Backend("mosaic", mosaic.all_reduce, supports=_mosaic_supports),
        Backend("xla", reference.all_reduce),
    ),
)


def in_kernel_window(arrays: Sequence[jax.Array], devices: int) -> bool:
    """Whether a request naming ``mosaic`` among other backends takes the kernel for
    ``arrays`` summed over ``devices`` (``KERNEL_*``; one process)."""
    payload = sum(x.size * np.dtype(x.dtype).itemsize for x in arrays)
    return (
        devices == KERNEL_DEVICES
        and KERNEL_MIN_BYTES <= payload <= KERNEL_MAX_BYTES
        and jax.process_count() == 1
    )


def all_reduce(
    x: Any,
    axis_name: str,
    *,
    implementation: Implementation | Sequence[str] = "auto",
    config: None = None,
) -> Any:
    """The sum of ``x`` over the mesh axis ``axis_name``, on every device of it: what
    ``lax.psum(x, axis_name)`` computes, inside ``jax.shard_map`` (or any context that
    binds the axis).

    Args:
      x: an array or a pytree of floating arrays (any shapes; summed in one call).
      axis_name: a mesh axis bound by the enclosing ``shard_map``.
      implementation: ``"xla"`` and ``"auto"``: ``lax.psum`` (NCCL on GPUs). ``"mosaic"``:
        the one-shot Pallas Mosaic GPU kernel (``all_reduce/mosaic.py``; Hopper GPUs driven
        by one process, on a mesh whose device ids are row-major: ``mesh.device_ids`` of
        ``arange``, which the caller knows and this op cannot see). A sequence of names
        holding ``"mosaic"`` (a model's layers ask for ``("mosaic", "xla")`` on ``auto``,
        ``("mosaic",)`` on ``"mosaic"``: ``flax_models.sharding.psum_tp``): the kernel in
        the window where it was measured faster (``KERNEL_*``: two devices of one process,
        2-16 MiB) when the device runs it, else ``psum``. The kernel sums in device order
        in fp32, so every device gets the same bits; ``psum`` leaves the order to NCCL.
      config: no backend of ``all_reduce`` takes block sizes; anything but None raises.

    Returns:
      ``x``'s structure, each array summed over the axis (``x`` itself when the axis has
      one device).
    """
    leaves, treedef = jax.tree.flatten(x)
    if config is not None:
        raise ValueError(f"config={config!r}: no backend of all_reduce takes block sizes")
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name={axis_name!r} must be a mesh axis name (a str)")
    try:
        devices = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here (call all_reduce "
            "inside jax.shard_map over a mesh with that axis)"
        ) from e
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    for i, leaf in enumerate(leaves):
        checks.check_floating(f"x[{i}]", leaf)
    if devices == 1 or not leaves:
        return x
    if isinstance(implementation, str):
        chosen: str | tuple[str, ...] = "xla" if implementation == "auto" else implementation
    else:
        chosen = "xla"
        if "mosaic" in backend_names(implementation) and in_kernel_window(leaves, devices):
            chosen = ("mosaic", "xla")  # the first of them the device runs
    call = Call(args=(tuple(leaves),), kwargs=dict(axis_name=axis_name))
    return jax.tree.unflatten(treedef, list(ALL_REDUCE.run(call, chosen)))
