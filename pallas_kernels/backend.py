"""Choice of implementation for every op: ``"auto" | "xla" | "triton" | "mosaic"``.

* ``xla``: the pure ``jax.numpy`` reference of each op (``<op>/reference.py``). Runs anywhere.
* ``triton``: Pallas kernels lowered through Triton. Compiled on a CUDA GPU; on any other
  platform the same kernels run with ``interpret=True`` (how CI checks their numerics).
* ``mosaic``: Pallas Mosaic GPU kernels (wgmma, TMA); Hopper (sm90) or newer only.
* ``auto``: ``mosaic`` where the op has it and the device supports it, else ``triton`` on a
  GPU, else ``xla``.

Each op registers the backends it has; asking for one it lacks, or one the device cannot
run, raises ``ValueError`` (the caller's request cannot be met), never a silent fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final, Literal, get_args

import jax

Implementation = Literal["auto", "xla", "triton", "mosaic"]
IMPLEMENTATIONS: Final[tuple[str, ...]] = get_args(Implementation)

# Mosaic GPU kernels use wgmma and TMA: Hopper (compute capability 9.0) or newer.
_MOSAIC_MIN_COMPUTE_CAPABILITY: Final = (9, 0)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved implementation.

    Attributes:
      name: ``"xla"``, ``"triton"`` or ``"mosaic"``.
      interpret: run Pallas kernels in interpret mode (no GPU present).
    """

    name: str
    interpret: bool = False


def _default_device() -> jax.Device:
    return jax.devices()[0]


def on_gpu(device: jax.Device | None = None) -> bool:
    """Whether ``device`` (default: JAX's first device) is a CUDA GPU."""
    device = device or _default_device()
    return device.platform == "gpu"


def supports_mosaic(device: jax.Device | None = None) -> bool:
    """Whether ``device`` can run Mosaic GPU kernels (sm90 or newer)."""
    device = device or _default_device()
    if not on_gpu(device):
        return False
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return False
    major, minor = (int(v) for v in str(capability).split(".")[:2])
    return (major, minor) >= _MOSAIC_MIN_COMPUTE_CAPABILITY


def resolve(
    implementation: str,
    *,
    op: str,
    available: Collection[str],
    device: jax.Device | None = None,
) -> Backend:
    """Resolves ``implementation`` for ``op`` given the backends that op has.

    Args:
      implementation: one of ``IMPLEMENTATIONS``.
      op: the op's name, for error messages.
      available: the backends the op implements (a subset of ``xla, triton, mosaic``).
      device: the device to run on; JAX's first device by default.

    Raises:
      ValueError: unknown name, a backend the op lacks, or ``mosaic`` on a device
        older than Hopper.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    device = device or _default_device()
    gpu = on_gpu(device)
    if implementation == "auto":
        if "mosaic" in available and supports_mosaic(device):
            return Backend("mosaic")
        if "triton" in available and gpu:
            return Backend("triton")
        return Backend("xla")
    if implementation not in available:
        raise ValueError(
            f"implementation={implementation!r} is not available for {op}; "
            f"it has {sorted(available)}"
        )
    if implementation == "mosaic" and not supports_mosaic(device):
        raise ValueError(
            f"implementation='mosaic' for {op} needs a Hopper (sm90) or newer GPU; "
            f"the device is {device.device_kind!r}"
        )
    return Backend(implementation, interpret=implementation == "triton" and not gpu)


def dispatch(
    implementations: Mapping[str, Callable[..., Any]],
    implementation: str,
    *args: Any,
    op: str,
    **kwargs: Any,
) -> Any:
    """Resolves ``implementation`` among an op's ``implementations`` and calls it.

    Triton-lowered Pallas implementations also receive ``interpret=`` (True off-GPU).
    """
    backend = resolve(implementation, op=op, available=implementations)
    if backend.name == "triton":
        kwargs["interpret"] = backend.interpret
    return implementations[backend.name](*args, **kwargs)
