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

# Where a request naming ``mosaic`` among others takes the kernel: two devices and 1-16
# MiB a call. Measured on two H200s of one host in a Bamba-9B-shaped decode step
# (2026-11-27): at 256 rows (2 MiB a call), with the prototype of this kernel, 16.23 ms
# against 16.75 / 16.91 ms with psum alternated on one machine (16.27 on another); at one
# row (8 KiB) 5.37 against 4.35 ms, the kernel's launch (XLA's barrier and collective
# metadata, about 35 µs chained) costing more than NCCL's 19-25 µs. This op, with ``auto``
# then taking the kernel there, took 17.18 ms at 256 rows on a third machine without a
# psum run beside it, so ``auto`` keeps psum until one machine compares the two. On two
# H100s (2026-11-28) the model with its tp all-reduces in this window printed no row within
# 110 s, twice, while a chain of the kernel alone ran (25.9 against psum's 28.0 µs at 256
# rows); a hang or a slow compile, not yet known. Above
# 16 MiB (prefill) NCCL's own kernels were not measured against it, and on more devices a
# one-shot read moves more bytes than a ring.
KERNEL_DEVICES: Final = 2
KERNEL_MIN_BYTES: Final = 1 << 20
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
    ``arrays`` summed over ``devices`` (``KERNEL_*``)."""
    payload = sum(x.size * np.dtype(x.dtype).itemsize for x in arrays)
    return devices == KERNEL_DEVICES and KERNEL_MIN_BYTES <= payload <= KERNEL_MAX_BYTES


def all_reduce(
    x: Any, axis_name: str, *, implementation: Implementation | Sequence[str] = "auto"
) -> Any:
    """The sum of ``x`` over the mesh axis ``axis_name``, on every device of it: what
    ``lax.psum(x, axis_name)`` computes, inside ``jax.shard_map`` (or any context that
    binds the axis).

    Args:
      x: an array or a pytree of floating arrays (any shapes; summed in one call).
      axis_name: a mesh axis bound by the enclosing ``shard_map``.
      implementation: ``"xla"`` and ``"auto"``: ``lax.psum`` (NCCL on GPUs). ``"mosaic"``:
        the one-shot Pallas Mosaic GPU kernel (``all_reduce/mosaic.py``; Hopper GPUs driven
        by one process). A sequence of names holding ``"mosaic"`` (the layers of a model on
        ``implementation="mosaic"`` ask for ``("mosaic", "triton")``): the kernel in the
        window where it was measured faster (``KERNEL_*``: two devices, 1-16 MiB) when the
        device runs it, else ``psum``. The kernel sums in device order in fp32, so every device
        gets the same bits; ``psum`` leaves the order to NCCL.

    Returns:
      ``x``'s structure, each array summed over the axis (``x`` itself when the axis has
      one device).
    """
    leaves, treedef = jax.tree.flatten(x)
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
