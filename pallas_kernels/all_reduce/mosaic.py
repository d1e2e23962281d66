"""A one-shot all-reduce over a mesh axis as a Pallas Mosaic GPU kernel (GPUs of one host).

Every device reads every device's operand straight from its memory over NVLink
(``plgpu.remote_ref``; the peers' addresses come from XLA's collective metadata, so one
process drives all the GPUs) and writes the sum to its own output: one launch on the
compute stream, no NCCL stream to synchronise with. Where it pays and where it does not
(measured): ``api.py``'s ``KERNEL_*`` window.

Protocol, per thread block (each block owns the same tiles on every device):

1. XLA's cross-device barrier before the launch (Mosaic's default): every device's
   operands are written and its semaphores zeroed before any peer reads or signals.
2. The block sums its tiles over the devices in device order (fp32, whatever the dtype),
   so every device computes the same bits: the replicas a tensor-parallel model keeps
   never drift apart.
3. It signals "done reading" to the same block of every peer and waits for theirs, so no
   device leaves the kernel (and lets XLA reuse its operand's buffer) while a peer still
   reads it.

Several arrays go in one launch (a tuple, as ``psum`` takes): the Mamba2 mixer's folded
norm sends its partial output and its sums of squares together. Each array is flattened
and padded to whole 128-thread vectors (16 bytes a thread) by the caller
(:func:`flat_operands`).
"""

from __future__ import annotations

import functools
import math
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.backend import device_num_sms

# One warpgroup moves 16 bytes a thread per vector load; a tile is a whole number of them.
_THREADS: Final = 128
_VECTOR_BYTES: Final = 16
# Bytes of one array a block sums per step (each peer's tile is a load in flight).
TILE_BYTES: Final = 4096


def vector_size(dtype) -> int:
    """Elements a thread loads at once (16 bytes)."""
    return _VECTOR_BYTES // jnp.dtype(dtype).itemsize


def flat_operands(arrays: tuple) -> tuple[jax.Array, ...]:
    """Each array flattened and zero-padded to whole warpgroup vectors."""
    flat = []
    for x in arrays:
        unit = _THREADS * vector_size(x.dtype)
        f = x.reshape(-1)
        pad = -f.size % unit
        flat.append(jnp.pad(f, (0, pad)) if pad else f)
    return tuple(flat)


def _tile(size: int, dtype) -> int:
    """The largest tile (elements) of at most ``TILE_BYTES`` that divides ``size``."""
    tile = _THREADS * vector_size(dtype)
    while 2 * tile * jnp.dtype(dtype).itemsize <= TILE_BYTES and size % (2 * tile) == 0:
        tile *= 2
    return tile


def all_reduce(arrays: tuple, *, axis_name: str) -> tuple:
    """See :func:`pallas_kernels.all_reduce`; arguments are already validated.

    Differentiable, with ``lax.psum``'s own transposes. Under ``shard_map(check_vma=
    False)`` (the model's ``shard_call``) every device holds its own output's cotangent,
    and since every output is the sum of every input, each input's cotangent is the sum
    of them: this kernel again. Under the check, an input that varies over the axis gets
    the cotangent as it arrives, already summed over the devices by the transpose of the
    output's implicit ``pvary``."""
    arrays = tuple(arrays)
    varying = tuple(axis_name in _varying_axes(x) for x in arrays)
    return _differentiable_sum(axis_name, varying, arrays)


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual axes over which ``x`` varies (under ``shard_map(check_vma=True)``; none
    without that check)."""
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if kind is None else kind.varying


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _differentiable_sum(axis_name: str, varying: tuple[bool, ...], arrays: tuple) -> tuple:
    return summed_over_devices(arrays, axis_name=axis_name)


def _sum_fwd(axis_name: str, varying: tuple[bool, ...], arrays: tuple) -> tuple[tuple, None]:
    return summed_over_devices(arrays, axis_name=axis_name), None


def _sum_bwd(axis_name: str, varying: tuple[bool, ...], _, cotangents: tuple) -> tuple[tuple]:
    cotangents = tuple(cotangents)
    local = [c for c, v in zip(cotangents, varying, strict=True) if not v]
    summed = iter(summed_over_devices(tuple(local), axis_name=axis_name) if local else ())
    return (
        tuple(
            lax.pcast(c, axis_name, to="varying") if v else next(summed)
            for c, v in zip(cotangents, varying, strict=True)
        ),
    )


_differentiable_sum.defvjp(_sum_fwd, _sum_bwd)


def summed_over_devices(arrays: tuple, *, axis_name: str) -> tuple:
    """The kernel's launch: every array of ``arrays`` summed over ``axis_name``."""
    devices = lax.axis_size(axis_name)
    flat = flat_operands(arrays)
    tile_sizes = [_tile(f.size, f.dtype) for f in flat]
    plan = [(tile, f.size // tile) for tile, f in zip(tile_sizes, flat, strict=True)]
    blocks = min(sum(tiles for _, tiles in plan), device_num_sms())

    def kernel(*refs):
        count = len(flat)
        x_refs, y_refs, done = refs[:count], refs[count : 2 * count], refs[-1]
        me = lax.axis_index(axis_name)
        for x_ref, y_ref, (tile, tiles) in zip(x_refs, y_refs, plan, strict=True):
            layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=vector_size(x_ref.dtype))

            @plgpu.nd_loop((tiles,), collective_axes="blocks")
            def _sum_tile(info, x_ref=x_ref, y_ref=y_ref, tile=tile, layout=layout):
                (t,) = info.index
                part = pl.ds(t * tile, tile)
                # Every device's tile in flight at once, then summed in device order.
                tiles_of = [
                    plgpu.load(plgpu.remote_ref(x_ref, {axis_name: d}).at[part], layout=layout)
                    for d in range(devices)
                ]
                total = tiles_of[0].astype(jnp.float32)
                for other in tiles_of[1:]:
                    total = total + other.astype(jnp.float32)
                y_ref[part] = total.astype(y_ref.dtype)

        block = lax.axis_index("blocks")
        for step in range(1, devices):
            peer = lax.rem(me + step, devices)
            pl.semaphore_signal(done.at[block], device_id={axis_name: peer})
        pl.semaphore_wait(done.at[block], devices - 1)

    summed = plgpu.kernel(
        kernel,
        out_type=tuple(jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flat),
        grid=(blocks,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR((blocks,))],
        kernel_name=f"all_reduce_{devices}dev",
    )(*flat)
    return tuple(
        s[: math.prod(x.shape)].reshape(x.shape) for s, x in zip(summed, arrays, strict=True)
    )
