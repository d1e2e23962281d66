"""Backends and dispatch: how every op chooses what runs a call.

Each op (``ssd_scan``, ``causal_conv1d``, …) is an :class:`Op`: its validated call
(:class:`Call`) and its backends in order of preference. A :class:`Backend` describes one
implementation completely: the function, its block-size config type, the heuristic that
picks a config for a call, and a ``supports`` predicate that says why it cannot serve one.

* ``xla``: the pure ``jax.numpy`` reference of each op (``<op>/reference.py``). Runs anywhere.
* ``triton``: Pallas kernels lowered through Triton. Compiled on a CUDA GPU; on any other
  platform the same kernels run with ``interpret=True`` (how CI checks their numerics).
* ``mosaic``: Pallas Mosaic GPU kernels (wgmma, TMA); Hopper (sm90) or newer only.

``implementation="auto"`` takes the first backend, in the op's order, that the device runs
(``triton`` and ``mosaic`` only on a GPU) and that supports the call. An explicit name
that cannot serve the call raises ``ValueError`` saying why: there is no silent hand-off.
A sequence of names (``("mosaic", "triton")``) takes the first of them that serves the call,
which is how a model asks for "the best kernel of this family" per op.

``config=`` is the chosen backend's block sizes: it must be an instance of that backend's
config type and is checked against the call, never rewritten. Without it the backend's
default heuristic picks one. :func:`backend_for` tells which backend a call would run.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, get_args

import jax
import numpy as np

Implementation = Literal["auto", "xla", "triton", "mosaic"]
IMPLEMENTATIONS: Final[tuple[str, ...]] = get_args(Implementation)
BACKEND_NAMES: Final[tuple[str, ...]] = ("xla", "triton", "mosaic")

# Mosaic GPU kernels use wgmma and TMA: Hopper (compute capability 9.0) or newer.
_MOSAIC_MIN_COMPUTE_CAPABILITY: Final = (9, 0)
# Streaming multiprocessors assumed when no GPU is attached (H100 SXM): tiling heuristics
# then pick what they would pick on the GPU CI's kernels are checked for.
_DEFAULT_NUM_SMS: Final = 132


def _default_device() -> jax.Device:
    return jax.devices()[0]


def on_gpu(device: jax.Device | None = None) -> bool:
    """Whether ``device`` (default: JAX's first device) is a CUDA GPU."""
    device = device or _default_device()
    return device.platform == "gpu"


def device_num_sms(device: jax.Device | None = None) -> int:
    """Streaming multiprocessors of ``device`` (an H100's 132 off-GPU)."""
    device = device or _default_device()
    if on_gpu(device):
        return int(getattr(device, "core_count", _DEFAULT_NUM_SMS))
    return _DEFAULT_NUM_SMS


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


def backend_names(implementation: Sequence[str]) -> tuple[str, ...]:
    """A sequence ``implementation`` as a tuple of backend names; ``ValueError`` when it is
    empty or names something else."""
    try:
        names = tuple(implementation)
    except TypeError:
        raise ValueError(
            f"implementation={implementation!r} must be one of {IMPLEMENTATIONS} or a sequence "
            f"of backend names of {BACKEND_NAMES}"
        ) from None
    if not names or any(n not in BACKEND_NAMES for n in names):
        raise ValueError(
            f"implementation={implementation!r}: a sequence must name backends of {BACKEND_NAMES}"
        )
    return names


@dataclasses.dataclass(frozen=True)
class Call:
    """One validated call of an op: what every backend of the op receives.

    Attributes:
      args: positional arguments (arrays).
      kwargs: keyword arguments (arrays and static Python values).
      empty: the op's result when the call has nothing to compute (no tokens); no backend
        runs then.
      finish: maps the backend's result to the op's (e.g. drops an axis the api added).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    empty: Callable[[], Any] | None = None
    finish: Callable[[Any], Any] | None = None


def _always(*args: Any, **kwargs: Any) -> str | None:
    del args, kwargs
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op.

    Attributes:
      name: ``"xla"``, ``"triton"`` or ``"mosaic"``.
      fn: ``fn(*call.args, **call.kwargs, config=..., interpret=...)``; ``config`` is passed
        when ``config_type`` is set, ``interpret`` to ``triton`` backends.
      config_type: the block-size dataclass this backend takes (None: it takes none).
      default_config: ``default_config(*args, **kwargs) -> config_type``, the heuristic
        used when the caller passes no config.
      supports: ``supports(*args, **kwargs) -> str | None``: why this backend cannot serve
        the call (None: it can). Static facts only (shapes, dtypes, static arguments).
      check_config: ``check_config(config, *args, **kwargs)`` raises ``ValueError`` when a
        config cannot serve the call (its own fields are checked by the config type).
    """

    name: str
    fn: Callable[..., Any]
    config_type: type | None = None
    default_config: Callable[..., Any] | None = None
    supports: Callable[..., str | None] = _always
    check_config: Callable[..., None] | None = None

    def __post_init__(self):
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"backend name {self.name!r} must be one of {BACKEND_NAMES}")
        if (self.config_type is None) != (self.default_config is None):
            raise ValueError(f"{self.name}: config_type and default_config go together")

    def device_reason(self, device: jax.Device, *, auto: bool) -> str | None:
        """Why ``device`` cannot run this backend (``auto``: whether ``auto`` would pick it
        there; Triton kernels interpret off-GPU only when asked for by name)."""
        if self.name == "mosaic" and not supports_mosaic(device):
            return (
                f"Mosaic GPU kernels need a Hopper (sm90) or newer GPU, not {device.device_kind!r}"
            )
        if self.name == "triton" and auto and not on_gpu(device):
            return "auto runs Triton kernels on a GPU only"
        return None


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backend chosen for a call, and how it runs."""

    backend: Backend
    interpret: bool


class _Probe(Exception):
    """Raised by :meth:`Op.run` under :func:`backend_for`: carries the selection out."""

    def __init__(self, selection: Selection):
        super().__init__(selection.backend.name)
        self.selection = selection


_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("_PROBING", default=False)


@dataclasses.dataclass(frozen=True)
class Op:
    """An op's backends in ``auto``'s order of preference."""

    name: str
    backends: tuple[Backend, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    def backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        raise ValueError(
            f"implementation={name!r} is not available for {self.name}; it has {list(self.names)}"
        )

    def select(
        self,
        call: Call,
        implementation: str | Sequence[str] = "auto",
        config: Any = None,
        device: jax.Device | None = None,
    ) -> Selection:
        """The backend that runs ``call``; ``ValueError`` when none of those asked for can."""
        device = device or _default_device()
        if isinstance(implementation, str):
            if implementation not in IMPLEMENTATIONS:
                raise ValueError(
                    f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}"
                )
            auto = implementation == "auto"
            candidates = self.backends if auto else (self.backend(implementation),)
        else:
            auto = False
            names = backend_names(implementation)
            candidates = tuple(self.backend(n) for n in names if n in self.names)
            if not candidates:
                raise ValueError(
                    f"implementation={names!r}: {self.name} has none of them ({list(self.names)})"
                )
        reasons = []
        for backend in candidates:
            reason = backend.device_reason(device, auto=auto)
            if (
                reason is None
                and config is not None
                and not isinstance(config, backend.config_type or ())
            ):
                reason = (
                    f"config of type {_qualified_name(type(config))} is not this backend's "
                    f"({_qualified_name(backend.config_type)})"
                )
            if reason is None and backend.name != "xla":
                reason = _wide_float_reason(call)
            if reason is None:
                reason = backend.supports(*call.args, **call.kwargs)
            if reason is None:
                return Selection(backend, interpret=backend.name == "triton" and not on_gpu(device))
            reasons.append(f"{backend.name}: {reason}")
        raise ValueError(
            f"{self.name}: implementation={implementation!r} cannot serve this call ("
            + "; ".join(reasons)
            + ")"
        )

    def run(
        self,
        call: Call,
        implementation: str | Sequence[str] = "auto",
        config: Any = None,
    ) -> Any:
        """Selects the backend for ``call`` and runs it with a checked (or default) config."""
        selection = self.select(call, implementation, config)
        if _PROBING.get():
            raise _Probe(selection)
        if call.empty is not None:
            return call.empty()
        backend = selection.backend
        extra: dict[str, Any] = {}
        if backend.config_type is not None:
            if config is None:
                config = backend.default_config(*call.args, **call.kwargs)
            elif backend.check_config is not None:
                backend.check_config(config, *call.args, **call.kwargs)
            extra["config"] = config
        if backend.name == "triton":
            extra["interpret"] = selection.interpret
        if backend.name == "xla":
            out = _run_traced_once(backend.fn, call.args, call.kwargs | extra)
        else:
            with pallas_dtypes():
                out = _run_traced_once(backend.fn, call.args, call.kwargs | extra)
        return out if call.finish is None else call.finish(out)


# Marks an operand's place among a call's constants (``None`` is never a pytree leaf, but
# spelling it out keeps that fact out of the code).
_OPERAND: Final = object()


def _run_traced_once(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` under ``jax.jit``: the arrays are its operands, every other
    leaf (ints, floats, flags, configs) a compile-time constant.

    Why: a model calls each kernel once a layer with the same shapes and constants. Under
    ``jax.jit`` JAX traces such a call once and lowers it once per program (one function
    that every layer calls), where a bare call lowered every layer's ``pallas_call`` to
    Triton IR again and handed XLA one kernel per call: a Bamba-9B engine step (256 decode
    rows and 4096 prompt tokens, ~240 kernel calls) took ~160 s from first call to result
    on an H200, and takes 24 s so. A call without arrays, or whose constants are not
    hashable, runs bare.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_operand = [isinstance(leaf, jax.Array | np.ndarray) for leaf in leaves]
    operands = [leaf for leaf, operand in zip(leaves, is_operand, strict=True) if operand]
    constants = tuple(
        _OPERAND if operand else leaf for leaf, operand in zip(leaves, is_operand, strict=True)
    )
    try:
        hash(constants)
    except TypeError:
        operands = []
    if not operands:
        return fn(*args, **kwargs)
    return _traced(operands, fn=fn, treedef=treedef, constants=constants)


@functools.partial(jax.jit, static_argnames=("fn", "treedef", "constants"))
def _traced(operands: list[Any], *, fn, treedef, constants) -> Any:
    remaining = iter(operands)
    leaves = [next(remaining) if leaf is _OPERAND else leaf for leaf in constants]
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return fn(*args, **kwargs)


def pallas_dtypes():
    """Context manager: JAX's 32-bit dtype defaults, whatever ``jax_enable_x64`` says.

    Pallas backends build their kernels inside it (:meth:`Op.run` does for the forward
    pass; a backward pass that builds Pallas kernels must enter it too). Under x64, Python
    ints would otherwise turn into int64 next to int32 program ids and loaded indices
    (``lax.div`` and ref indexing then refuse to mix them), ``jnp.arange`` into int64 and
    ``jnp.zeros`` into float64, and on the GPU the kernels' index arithmetic would run in
    64 bits: inside it, a kernel is the same program with or without x64.
    """
    return jax.enable_x64(False)


def _wide_float_reason(call: Call) -> str | None:
    """Why Pallas kernels cannot serve ``call``: a float64 argument (possible under x64;
    the kernels compute in fp32 from 16- and 32-bit inputs), or None."""
    for leaf in jax.tree.leaves((call.args, call.kwargs)):
        # Arrays, and dtype arguments (``state_dtype``).
        candidate = leaf if isinstance(leaf, (np.dtype, type)) else getattr(leaf, "dtype", None)
        try:
            dtype = None if candidate is None else np.dtype(candidate)
        except TypeError:
            continue
        if dtype is not None and dtype.kind in "fc" and dtype.itemsize >= 8:
            return f"Pallas kernels take 16- and 32-bit floats, not {dtype.name}"
    return None


def _qualified_name(cls: type | None) -> str:
    """``pallas_kernels.ssd.triton_config.BlockSizes``: every backend's config is a
    ``BlockSizes``."""
    return "none" if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def backend_for(op: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """The name of the backend that ``op(*args, **kwargs)`` would run; nothing runs.

    ``op`` is a public op (``pk.ssd_scan``, …); the arguments are the op's own, including
    ``implementation=`` and ``config=``. Raises the ``ValueError`` the call would raise
    when no backend asked for can serve it.

    Example::

        pk.backend_for(pk.masked_tail_attention, q, k_cache, v_cache, query_start_loc=qsl,
                       kv_lens=kv_lens, slot_ids=slots)   # "mosaic" on an H200 prefill
    """
    token = _PROBING.set(True)
    try:
        op(*args, **kwargs)
    except _Probe as probe:
        return probe.selection.backend.name
    finally:
        _PROBING.reset(token)
    raise TypeError(f"{getattr(op, '__name__', op)!r} is not an op that dispatches on backends")
