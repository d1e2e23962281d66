"""Tensor parallelism over a mesh axis named ``"tp"`` (Megatron-style, as vLLM does it).

Every mixer splits its heads (or widths) over the ``tp`` devices; the residual stream stays
replicated. Column-parallel projections (in_proj, q/k/v, gate_up, expert up) keep each
device's output columns local, row-parallel ones (out_proj, o_proj, down, expert down) sum
their partial products with one all-reduce::

    device d:  h ─ in_proj[:, cols_d] ─ conv, SSD, norm on heads d ─ out_proj[rows_d, :] ─┐
                                                                              psum over tp ┘

Parameters whose columns mix several segments are stored in a *tp-major* layout, so that a
contiguous split over tp gives each device exactly its own segments:

- Mamba2 ``in_proj`` (z | x | B | C | dt) and the conv (x | B | C): device d's block is
  ``z_d | x_d | B_d | C_d | dt_d``. B and C groups are split when tp divides
  ``mamba_groups``; otherwise (tp a multiple of it, e.g. one group) each device holds a copy
  of the one group its heads read, as vLLM does. The gated RMSNorm is per group: local when
  groups are split, else its sum of squares is all-reduced over the devices sharing the group.
- Attention ``k_proj``/``v_proj``: KV heads split when tp divides ``num_kv_heads``, else each
  device holds a copy of the KV head its query heads use.
- Gated experts' fused ``gate | up``: device d's block is ``gate_d | up_d``.
- The untied head ``lm_head``: its vocabulary split when tp divides it, so a step's
  logits come out split over the devices.

``tp_layout`` maps a parameter from the single-device layout (the checkpoints') to this one;
the model's init and ``load_hf_checkpoint`` both go through it, so a sharded model has the
single-device model's values. The Pallas ops cannot be partitioned by XLA: each mixer runs
its body under ``jax.shard_map`` on per-device shapes (a copy of the module with the local
config, ``local_config``); the plain matmuls of the MLPs are left to XLA's partitioner.

Data parallelism over a mesh axis named ``"dp"`` (with or without ``"tp"``): the parameters
are replicated over dp (each dp group holds the whole model, split over its tp devices) and
the ``Engine``'s sequence slots are split into dp equal groups, each with its own share of
the KV page pool and of the Mamba snapshot pool. Every cache array gets ``"dp"`` on its
leading axis (slots, pages or snapshot entries; ``split_groups``), so a group's devices hold
only its slots. A step stays one program over the whole mesh (one per bucket, whatever dp):
its arrays are laid out group-major, every group padded to the same buckets, and its
``ForwardBatch`` is *grouped* (``groups = dp``, a leading group axis on every array, with
group-local slot, page and snapshot ids). ``shard_call`` then splits the tokens, the batch
and the caches over dp, so inside the ``shard_map`` each device sees exactly its group's
batch and caches and the kernels run unchanged; the embedding, MLPs, norms and head
partition the dp-split tokens through XLA. A plain forward (``model(ids)``) runs replicated
over dp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.batch import ForwardBatch
from flax_models.config import HybridConfig
from flax_models.lazy_tensors import LazyTensor

PyTree = Any  # an array or a nested tuple, list or dict of arrays
TP = "tp"  # the mesh axis the heads are split over
DP = "dp"  # the mesh axis the engine's sequence slots are split over


def _check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if TP not in mesh.axis_names and DP not in mesh.axis_names:
        raise ValueError(
            f"the mesh needs an axis named {TP!r} (tensor parallel) or {DP!r} (data parallel), "
            f"or both; it has {mesh.axis_names}"
        )


def tp_size(mesh: Mesh | None) -> int:
    """Devices along ``"tp"`` (1 without a mesh or such an axis); ValueError when the mesh
    has neither ``"tp"`` nor ``"dp"``."""
    if mesh is None:
        return 1
    _check_mesh(mesh)
    return mesh.shape.get(TP, 1)


def dp_size(mesh: Mesh | None) -> int:
    """Devices along ``"dp"``, i.e. the engine's slot groups (1 without a mesh or such an
    axis); ValueError when the mesh has neither ``"tp"`` nor ``"dp"``."""
    if mesh is None:
        return 1
    _check_mesh(mesh)
    return mesh.shape.get(DP, 1)


def with_tp_axis(mesh: Mesh | None) -> Mesh | None:
    """``mesh`` as the model places itself on: a ``"tp"`` axis of size 1 appended when it
    has none (a ``"dp"``-only mesh), so that every spec naming ``"tp"`` is valid on it, and
    every axis ``Auto``. The model shards through ``shard_map`` and sharding constraints,
    which take ``Auto`` axes; ``jax.make_mesh`` makes ``Explicit`` ones by default, whose
    sharding-in-types rules the layers' collectives are not written to (a mesh of the same
    devices with ``Auto`` axes computes the same). Meshes already so are returned as they
    are."""
    if mesh is None:
        return None
    _check_mesh(mesh)
    auto = all(kind == AxisType.Auto for kind in mesh.axis_types)
    if TP in mesh.axis_names and auto:
        return mesh
    devices, names = mesh.devices, mesh.axis_names
    if TP not in names:
        devices, names = devices[..., None], (*names, TP)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def psum_tp(
    x: PyTree, implementation: str | tuple[str, ...] = "auto", mesh: Mesh | None = None
) -> PyTree:
    """``x`` (an array or a tuple of arrays: one all-reduce for all of them) summed over
    ``"tp"`` inside ``shard_call`` over ``mesh``, through ``pallas_kernels.all_reduce``;
    ``x`` itself on a ``"tp"`` axis of size 1 (a dp-only mesh), where a ``psum`` would still
    compile to an all-reduce over groups of one device, launched once per mixer.

    ``implementation`` is the layer's, a preference for the ops' kernels. ``"auto"`` asks
    for ``("mosaic", "xla")``: the Mosaic kernel in ``all_reduce``'s window (two devices of
    one process, 2-16 MiB a call: a 256-row decode step's, where it was measured faster
    than NCCL), ``psum`` elsewhere. One backend name goes as a one-name family, so a model
    run on ``"triton"`` (which has no all-reduce) sums with ``psum`` and one on
    ``"mosaic"`` takes the kernel in the window. On a mesh the kernel does not serve
    (``kernel_mesh``: device ids not row-major, or a ``"dp"`` axis beside ``"tp"``),
    ``psum``."""
    if implementation == "auto":
        implementation = ("mosaic", "xla")
    elif isinstance(implementation, str):
        implementation = (implementation,)
    if not kernel_mesh(mesh):
        implementation = "xla"
    return pk.all_reduce(x, TP, implementation=implementation)


def kernel_mesh(mesh: Mesh | None) -> bool:
    """Whether the tp all-reduce may take the Mosaic kernel on ``mesh``: Mosaic lowers
    kernels that talk to other devices only where the device ids are ``arange`` in
    row-major order (its own check, raised at lowering), and the kernel has run only on
    meshes whose one axis of several devices is ``"tp"``."""
    if mesh is None:
        return False
    ids = np.asarray(mesh.device_ids).ravel()
    alone = all(size == 1 for name, size in mesh.shape.items() if name != TP)
    return alone and bool(np.array_equal(ids, np.arange(ids.size)))


# Rows a device (first and last) of the tp steps that are compiled with XLA's split-K
# rewrite off. At these rows XLA's GEMM autotuner splits the row-parallel products
# (out_proj, o_proj, down: K the device's share, N the full width) over their contraction
# in two, and then sums the halves in a reduce pass of its own, which its timing leaves
# out. With that split forced off, Bamba-9B's tp = 2 decode step took 16.13 and 15.94 ms at
# 256 rows, against 16.47 and 16.30, and 7.33 ms at 64 rows, against 7.80. At one row it
# took 4.46 ms against 4.24, presumably because there the split spreads a product that
# only reads its weights over more SMs. (Two H200s, 2026-11-29,
# benchmarks/results/nvidia_h200x2_tp_unsplit_k.json.) Steps of 2-63 and of more than 256
# rows were not measured either way, so the window is the rows that were.
UNSPLIT_K_ROWS = (64, 256)


def step_compiler_options(mesh: Mesh | None, rows: int) -> dict[str, Any]:
    """XLA options for an engine step over ``mesh`` whose products have ``rows`` rows a
    device: ``xla_gpu_experimental_force_split_k = 1`` (no split-K rewrite) for tp > 1
    within ``UNSPLIT_K_ROWS``, none elsewhere. On a CPU the option is accepted and changes
    nothing."""
    low, high = UNSPLIT_K_ROWS
    if tp_size(mesh) > 1 and low <= rows <= high:
        return {"xla_gpu_experimental_force_split_k": 1}
    return {}


def _local_copies(total: int, tp: int) -> int:
    """Per device: total / tp when tp divides it, else 1 (a copy of the one it needs)."""
    return total // tp if total % tp == 0 else 1


def check_tp(cfg: HybridConfig, tp: int) -> None:
    """ValueError naming the first field of ``cfg`` that cannot be split over ``tp``."""

    def divides(field: str, *, or_multiple: bool = False) -> None:
        value = getattr(cfg, field)
        if value % tp and not (or_multiple and tp % value == 0):
            extra = " (or be a divisor of it)" if or_multiple else ""
            raise ValueError(f"{field}={value} must be divisible by tp={tp}{extra}")

    pattern = set(cfg.layer_pattern)
    if pattern & set("MP"):
        divides("mamba_num_heads")
        divides("mamba_groups", or_multiple=True)
    if pattern & set("*P"):
        divides("num_heads")
        divides("num_kv_heads", or_multiple=True)
    if "-" in pattern or cfg.mlp_per_layer:
        divides("intermediate_size")
    if "E" in pattern or cfg.moe_per_layer:
        divides("moe_intermediate_size")
        if cfg.shared_expert_intermediate_size:
            divides("shared_expert_intermediate_size")


def local_config(cfg: HybridConfig, tp: int) -> HybridConfig:
    """The configuration one device runs: its share of heads, groups and widths."""
    if tp == 1:
        return cfg
    fields = dict(
        mamba_num_heads=cfg.mamba_num_heads // tp,
        mamba_groups=_local_copies(cfg.mamba_groups, tp),
        num_heads=cfg.num_heads // tp,
        num_kv_heads=_local_copies(cfg.num_kv_heads, tp),
        intermediate_size=cfg.intermediate_size // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
    )
    if not set("MP") & set(cfg.layer_pattern):
        fields.update(mamba_num_heads=cfg.mamba_num_heads, mamba_groups=cfg.mamba_groups)
    if not set("*P") & set(cfg.layer_pattern):
        fields.update(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    return dataclasses.replace(cfg, **fields)


# ------------------------------------------------------------------------ layouts


def _segments(segments: list[tuple[int, int]], tp: int) -> np.ndarray:
    """Column order of a tp-major layout. Each segment is ``(units, unit_size)``: ``units``
    heads or groups of ``unit_size`` columns, one segment after another in the single-device
    layout. Device d takes units ``d·units/tp ..`` of a segment tp divides, else a copy of
    the one unit ``d // (tp / units)`` its heads read. Example, z and x of 4 heads of one
    column and B of 1 group of 2 columns, tp = 2: single layout ``z0 z1 z2 z3 x0 x1 x2 x3 b0
    b1`` (columns 0-9) → ``[0 1 4 5 8 9 | 2 3 6 7 8 9]``."""
    order = []
    for d in range(tp):
        start = 0
        for units, size in segments:
            if units % tp == 0:
                local, first = units // tp, d * (units // tp)
            else:  # tp is a multiple of units: one copied unit per device
                local, first = 1, d // (tp // units)
            order.append(start + np.arange(first * size, (first + local) * size))
            start += units * size
    return np.concatenate(order)


@functools.cache
def _order(cfg: HybridConfig, tp: int, name: str) -> np.ndarray:
    """The tp-major column order of one fused parameter kind (built only when used)."""
    H, P_, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_groups, cfg.mamba_state_size
    conv = [(H, P_), (G, N), (G, N)]  # x | B | C
    inner = cfg.moe_intermediate_size
    segments = {
        "in_proj": [(H, P_), *conv, (H, 1)],  # z | x | B | C | dt
        "conv": conv,
        "kv": [(cfg.num_kv_heads, cfg.head_dim)],
        "gate_up": [(tp, inner // tp), (tp, inner // tp)],  # gate | up
    }[name]
    return _segments(segments, tp)


def _layout_rule(path: tuple[str, ...], cfg: HybridConfig) -> tuple[str, int] | None:
    """(order name, axis) for a parameter stored in a tp-major layout, else None."""
    name = path[-1]
    owner = path[-2] if len(path) > 1 else ""
    if owner == "in_proj":
        return "in_proj", -1
    if name in ("conv_weight", "conv_bias"):
        return "conv", 0
    if owner in ("k_proj", "v_proj"):
        return "kv", -1
    if name == "experts_up" and cfg.moe_activation == "silu":
        return "gate_up", -1
    return None


def tp_layout(path: tuple[str, ...], value, cfg: HybridConfig, tp: int):
    """``value`` (NumPy, JAX or a ``LazyTensor``) of the parameter at module ``path`` in the
    single-device layout → the tp-major layout (a gather along one axis; unchanged for most
    parameters)."""
    rule = _layout_rule(path, cfg) if tp > 1 else None
    if rule is None:
        return value
    order, axis = rule
    if isinstance(value, LazyTensor):  # a checkpoint's tensor, not read yet
        return value.take(_order(cfg, tp, order), axis=axis)
    xp = np if isinstance(value, np.ndarray) else jax.numpy
    return xp.take(value, _order(cfg, tp, order), axis=axis)


# ------------------------------------------------------------------------ specs

_COLUMN = ("in_proj", "q_proj", "k_proj", "v_proj", "up")  # output split
_ROW = ("out_proj", "o_proj", "down")  # input split, output all-reduced
_HEADS = ("conv_weight", "conv_bias", "A_log", "D", "dt_bias", "norm_weight")


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
    """The ``PartitionSpec`` of the parameter of ``shape`` at module ``path`` on ``tp``
    devices (replicated when no rule).

    The untied head ``lm_head`` splits its vocabulary (the logits come out split over tp,
    and the step's greedy argmax and the sampler reduce over them where they lie): at one
    row it is the largest single read of a decode step. A vocabulary tp does not divide
    keeps it whole, as does a head tied to the embedding table (the lookup would need the
    table whole)."""
    name = path[-1]
    owner = path[-2] if len(path) > 1 else ""
    if owner in _COLUMN:
        return P(None, TP) if name == "kernel" else P(TP)
    if owner == "gate_up":  # kernel [D, 2, F], bias [2, F]: F split
        return P(*([None] * (len(shape) - 1)), TP)
    if owner in _ROW:
        return P(TP, None) if name == "kernel" else P()
    if name in _HEADS:
        return P(TP, *([None] * (len(shape) - 1)))
    if name == "experts_up":
        return P(None, None, TP)
    if name == "experts_down":
        return P(None, TP, None)
    if owner == "lm_head" and name == "kernel" and shape[-1] % tp == 0:
        return P(None, TP)
    return P()  # embeddings, norms, routers


def split_groups(specs):
    """``specs`` (a ``PartitionSpec`` or a tree of them) with their leading axis split over
    ``"dp"``: ``P()`` → ``P("dp")``, ``P(None, None, "tp")`` → ``P("dp", None, "tp")``. The
    leading axis of what they describe must be unsplit (tokens, sequences, slots, pages,
    snapshot entries, or a grouped batch's group axis)."""

    def split(spec: P) -> P:
        if spec and spec[0] is not None:
            raise ValueError(f"{spec} already splits its leading axis")
        return P(DP, *spec[1:])

    return jax.tree.map(split, specs, is_leaf=lambda x: isinstance(x, P))


def state_shardings(state, mesh: Mesh, prefix: tuple[str, ...] = ()):
    """A ``NamedSharding`` per variable of an ``nnx.State`` (same tree); ``prefix``: the
    module path of the state's owner, when it is a part of a model."""
    tp = tp_size(mesh)
    flat = []
    for path, var in nnx.to_flat_state(state):
        spec = param_spec((*prefix, *map(str, path)), var.shape, tp)
        flat.append((path, var.replace(NamedSharding(mesh, spec))))
    return nnx.from_flat_state(flat)


# ------------------------------------------------------------------------ shard_map


@functools.cache
def _local_graphdef(cls, cfg: HybridConfig, dtype, implementation):
    """The graph of ``cls`` built for one device's share (``local_config``), no mesh."""
    abstract = nnx.eval_shape(
        lambda: cls(cfg, dtype=dtype, implementation=implementation, rngs=nnx.Rngs(0))
    )
    return nnx.graphdef(abstract)


def shard_call(module, body, args, in_specs, out_specs, *, groups: int | None = None):
    """Runs ``body(local_module, *args)`` under ``jax.shard_map`` over ``module.mesh``:
    ``local_module`` is a copy of ``module`` with the local config (``local_config``) and
    this device's shards of its parameters (split as ``param_spec`` says); ``args`` are
    split as ``in_specs`` says and the outputs assembled as ``out_specs`` says.

    ``groups > 1`` (by default the ``groups`` of a ``ForwardBatch`` among ``args``, else 1):
    the engine's data-parallel step. Every spec then also splits its leading axis over
    ``"dp"`` (``split_groups``): the packed tokens ``[groups · T, ...]`` (group-major), the
    caches' slots, pages and snapshot entries, and the grouped batch's group axis, which
    ``body`` does not see: it gets its group's own ``ForwardBatch`` (``groups = 1``)."""
    mesh = module.mesh
    if groups is None:
        groups = max((a.groups for a in args if isinstance(a, ForwardBatch)), default=1)
    if groups > 1:
        if groups != dp_size(mesh):
            raise ValueError(f"a batch of {groups=} needs a mesh with dp={groups}")
        in_specs, out_specs = split_groups(tuple(in_specs)), split_groups(out_specs)
    tp = tp_size(mesh)
    flat = list(nnx.to_flat_state(nnx.state(module)))
    paths = [tuple(map(str, path)) for path, _ in flat]
    values = [var[...] for _, var in flat]
    specs = [param_spec(path, value.shape, tp) for path, value in zip(paths, values, strict=True)]
    graphdef = _local_graphdef(
        type(module), local_config(module.cfg, tp), module.dtype, module.implementation
    )

    def run(values, *args):
        state = nnx.from_flat_state(
            [(path, var.replace(v)) for (path, var), v in zip(flat, values, strict=True)]
        )
        args = [a.group(0) if isinstance(a, ForwardBatch) and a.groups > 1 else a for a in args]
        return body(nnx.merge(graphdef, state), *args)

    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(specs, *in_specs),
        out_specs=out_specs,
        check_vma=False,
    )(values, *args)


def from_tp_layout(path: tuple[str, ...], value: np.ndarray, cfg: HybridConfig, tp: int):
    """The inverse of :func:`tp_layout`: a whole parameter (NumPy) in the tp-major layout →
    the single-device layout. Columns copied onto several devices (a group or KV head
    shared by their heads) are read from their first copy; every copy holds the same
    values unless something wrote them apart."""
    rule = _layout_rule(path, cfg) if tp > 1 else None
    if rule is None:
        return value
    name, axis = rule
    order = _order(cfg, tp, name)
    first = np.empty(int(order.max()) + 1, np.int64)
    first[order[::-1]] = np.arange(len(order))[::-1]  # the first position of each column
    return np.take(value, first, axis=axis)
