"""Hugging Face checkpoints → ``HybridLM``: the whole name mapping lives in this file.

``load_hf_checkpoint(directory)`` reads ``config.json`` and one or several
``*.safetensors`` (with ``model.safetensors.index.json``), renames every tensor to its
module path, transforms it (PyTorch ``[out, in]`` linears → ``[in, out]`` kernels, conv
weights ``[C, 1, K]`` → ``[C, K]``, an MLP's gate and up stacked into its one
``gate_up`` weight ``[H, 2, I]`` (Granite's fused ``[2I, H]`` cut in two for it),
per-expert weights stacked and expert weights ``[E, out, in]`` → ``[E, in, out]``),
checks its shape against the abstract model, and raises one ``ValueError`` listing every
missing, unexpected or mis-shaped tensor. Tied embeddings need no ``lm_head``.

Tensors are read on demand (``flax_models.lazy_tensors``): the transforms make views, the
shapes are checked before anything is read, and a sharded load reads for each device the
parts of the files its shards hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open

from flax_models.config import HybridConfig
from flax_models.lazy_tensors import LazyTensor, StoredTensor, stack
from flax_models.model import HybridLM
from flax_models.sharding import (
    check_tp,
    from_tp_layout,
    param_spec,
    tp_layout,
    tp_size,
    with_tp_axis,
)

# The name table, read both ways: HF → module when loading (``hf_to_module_path``), module
# → HF when saving (``module_path_to_hf``). Names are templates whose ``{slots}`` stand for
# the patterns of ``_SLOTS``; a rule's HF and module templates name the same slots.
_SLOTS = {
    "root": "backbone|model",  # layer prefixes: either is read, the family's is written
    "i": r"\d+",  # layer index
    "proj": "in_proj|out_proj|q_proj|k_proj|v_proj|o_proj",
    "ud": "up|down",
    "ssm": "A_log|D|dt_bias",
}
# The ``{root}`` a family's checkpoints are written with.
_ROOTS = {"mamba2": "backbone", "nemotron_h": "backbone"}


@dataclasses.dataclass(frozen=True)
class _Transform:
    """HF tensor → module value (``load``; NumPy or ``LazyTensor``) and back (``save``)."""

    load: Callable
    save: Callable[[np.ndarray], np.ndarray]


_SAME = _Transform(lambda x: x, lambda x: x)
# PyTorch linears [out, in] ↔ kernels [in, out].
_LINEAR = _Transform(lambda x: x.T, lambda x: x.T)
# Conv weights [C, 1, K] ↔ [C, K].
_CONV = _Transform(lambda x: x[:, 0, :], lambda x: x[:, None, :])
# Gate and up stacked [2, I, H] (``_stack_gate_up``) ↔ the MLP's ``gate_up`` kernel [H, 2, I].
_GATE_UP = _Transform(lambda x: x.transpose(2, 0, 1), lambda x: x.transpose(1, 2, 0))
# Granite's fused gate|up [2I, H]: cut in two, halves stacked, then as _GATE_UP.
_FUSED_GATE_UP = _Transform(
    lambda x: _GATE_UP.load(stack([x[: len(x) // 2], x[len(x) // 2 :]])),
    lambda x: _GATE_UP.save(x).reshape(-1, x.shape[0]),
)
# Stacked expert linears [E, out, in] ↔ grouped-matmul weights [E, in, out].
_EXPERTS = _Transform(lambda x: x.transpose(0, 2, 1), lambda x: x.transpose(0, 2, 1))


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One row of the table: HF template ↔ module template.

    ``kinds``: the layer kinds (``HybridConfig.layer_pattern`` letters) whose tensors are
    saved under this rule (None: any); ``families``: the families saved with it (None: all).
    Loading tries every rule, in order, whatever the family's kinds and families.
    """

    hf: str
    module: str
    transform: _Transform = _SAME
    kinds: str | None = None
    families: tuple[str, ...] | None = None


# 1) Family prefixes (HF name prefix ↔ module path prefix). First match wins.
_GRANITE, _NEMOTRON = ("granitemoehybrid",), ("nemotron_h",)
_SPLIT_GATE_UP = ("bamba", "falcon_h1")  # gate_proj and up_proj saved apart
_RENAMES: dict[str, list[_Rule]] = {
    "mamba2": [
        _Rule("backbone.embeddings.", "embed."),
        _Rule("backbone.norm_f.", "final_norm."),
        _Rule("{root}.layers.{i}.norm.", "layers.{i}.norm."),
        _Rule("{root}.layers.{i}.mixer.", "layers.{i}.mixer."),
    ],
    "bamba": [
        _Rule("model.embed_tokens.", "embed."),
        _Rule("model.final_layernorm.", "final_norm."),
        _Rule("{root}.layers.{i}.input_layernorm.", "layers.{i}.norm."),
        _Rule("{root}.layers.{i}.mamba.", "layers.{i}.mixer.", kinds="M"),
        _Rule("{root}.layers.{i}.self_attn.", "layers.{i}.mixer.", kinds="*"),
        _Rule("{root}.layers.{i}.pre_ff_layernorm.", "layers.{i}.mlp_norm."),
        _Rule("{root}.layers.{i}.feed_forward.", "layers.{i}.mlp."),
    ],
    "granitemoehybrid": [
        _Rule("model.embed_tokens.", "embed."),
        _Rule("model.norm.", "final_norm."),
        _Rule("{root}.layers.{i}.input_layernorm.", "layers.{i}.norm."),
        _Rule("{root}.layers.{i}.mamba.", "layers.{i}.mixer.", kinds="M"),
        _Rule("{root}.layers.{i}.self_attn.", "layers.{i}.mixer.", kinds="*"),
        _Rule("{root}.layers.{i}.post_attention_layernorm.", "layers.{i}.mlp_norm."),
        _Rule("{root}.layers.{i}.shared_mlp.", "layers.{i}.mlp."),
        _Rule("{root}.layers.{i}.block_sparse_moe.", "layers.{i}.moe."),  # routed experts
    ],
}
_RENAMES["nemotron_h"] = _RENAMES["mamba2"]
# Falcon-H1: every layer holds both mixers side by side (ParallelHybridMixer), each under
# its own name, and the MLP after them.
_RENAMES["falcon_h1"] = [
    _Rule("model.embed_tokens.", "embed."),
    _Rule("model.final_layernorm.", "final_norm."),
    _Rule("{root}.layers.{i}.input_layernorm.", "layers.{i}.norm."),
    _Rule("{root}.layers.{i}.mamba.", "layers.{i}.mixer.mamba."),
    _Rule("{root}.layers.{i}.self_attn.", "layers.{i}.mixer.attention."),
    _Rule("{root}.layers.{i}.pre_ff_layernorm.", "layers.{i}.mlp_norm."),
    _Rule("{root}.layers.{i}.feed_forward.", "layers.{i}.mlp."),
]
_COMMON_RENAMES = [_Rule("lm_head.", "lm_head.")]

# 2) Parameter names (suffixes, matched after the prefix is renamed). First match wins.
_PARAMS: list[_Rule] = [
    # Mixture of experts (before the dense rules, which would also match these names).
    # Granite (block_sparse_moe → moe): experts fused as input_linear [E, 2I, H] (gate|up)
    # and output_linear [E, H, I]. Nemotron-H (mixer): router "gate", per-expert linears
    # stacked by _stack_experts into experts.up_proj [E, I, H] / experts.down_proj [E, H, I].
    _Rule("moe.router.layer.weight", "moe.router.kernel", _LINEAR, families=_GRANITE),
    _Rule("moe.input_linear.weight", "moe.experts_up", _EXPERTS, families=_GRANITE),
    _Rule("moe.output_linear.weight", "moe.experts_down", _EXPERTS, families=_GRANITE),
    _Rule("mixer.gate.weight", "mixer.router.kernel", _LINEAR, families=_NEMOTRON),
    _Rule("mixer.gate.e_score_correction_bias", "mixer.score_correction_bias"),
    _Rule("experts.{ud}_proj", "experts_{ud}", _EXPERTS, families=_NEMOTRON),
    _Rule("shared_experts.{ud}_proj.weight", "shared_expert.{ud}.kernel", _LINEAR),
    _Rule("shared_experts.{ud}_proj.bias", "shared_expert.{ud}.bias"),
    _Rule("embed.weight", "embed.embedding"),
    _Rule("{proj}.weight", "{proj}.kernel", _LINEAR),
    _Rule("{proj}.bias", "{proj}.bias"),
    # Gated MLPs: gate_up_proj [2, I, H] is _stack_gate_up's (split again when saved),
    # input_linear [2I, H] Granite's.
    _Rule("gate_up_proj.weight", "gate_up.kernel", _GATE_UP, families=_SPLIT_GATE_UP),
    _Rule("gate_up_proj.bias", "gate_up.bias", families=_SPLIT_GATE_UP),
    _Rule("input_linear.weight", "gate_up.kernel", _FUSED_GATE_UP, families=_GRANITE),
    _Rule("output_linear.weight", "down.kernel", _LINEAR, families=_GRANITE),
    _Rule("{ud}_proj.weight", "{ud}.kernel", _LINEAR),
    _Rule("{ud}_proj.bias", "{ud}.bias"),
    _Rule("conv1d.weight", "conv_weight", _CONV),
    _Rule("conv1d.bias", "conv_bias"),
    _Rule("mixer.norm.weight", "mixer.norm_weight"),
    _Rule("mamba.norm.weight", "mamba.norm_weight"),  # Falcon-H1 with mamba_rms_norm
    _Rule("{ssm}", "{ssm}"),
    _Rule("norm.weight", "norm.weight"),
    _Rule("lm_head.weight", "lm_head.kernel", _LINEAR),
]


@functools.cache
def _pattern(template: str, *, prefix: bool) -> re.Pattern:
    """A template as a regex, each ``{slot}`` a named group: anchored at the start for a
    prefix, at the end for a suffix."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, slot, literal, ...
    regex = "".join(
        f"(?P<{part}>{_SLOTS[part]})" if k % 2 else re.escape(part) for k, part in enumerate(parts)
    )
    return re.compile("^" + regex if prefix else regex + "$")


def _rename(name: str, rules: list[_Rule], *, to_hf: bool, prefix: bool, **slots) -> tuple:
    """``name`` with the first matching rule's part (prefix or suffix) rewritten, and the
    rule; ``(None, None)`` when none matches. ``slots`` fill the target's unmatched slots."""
    for rule in rules:
        source, target = (rule.module, rule.hf) if to_hf else (rule.hf, rule.module)
        found = (re.match if prefix else re.search)(_pattern(source, prefix=prefix), name)
        if found is None:
            continue
        new = target.format(**(slots | found.groupdict()))
        return (new + name[found.end() :] if prefix else name[: found.start()] + new), rule
    return None, None


def _to_module(family: str, name: str) -> tuple[str, _Rule] | tuple[None, None]:
    """The module path an HF tensor name fills and the parameter rule that names it."""
    name, _ = _rename(name, _RENAMES[family] + _COMMON_RENAMES, to_hf=False, prefix=True)
    if name is None:
        return None, None
    return _rename(name, _PARAMS, to_hf=False, prefix=False)


def hf_to_module_path(family: str, name: str, tensor: np.ndarray) -> tuple[str, np.ndarray] | None:
    """The module path and value one HF tensor fills, or None when no rule matches."""
    path, rule = _to_module(family, name)
    return None if path is None else (path, rule.transform.load(tensor))


def hf_name_to_module_path(family: str, name: str) -> str | None:
    """The module path an HF tensor name fills (:func:`hf_to_module_path` without a
    tensor), or None when no rule matches."""
    return _to_module(family, name)[0]


def _to_hf(cfg: HybridConfig, path: str) -> tuple[str, _Rule]:
    family = cfg.family

    def saved(rule: _Rule, name: str) -> bool:
        if rule.families is not None and family not in rule.families:
            return False
        if rule.kinds is None:
            return True
        layer = re.match(r"layers\.(\d+)\.", name)
        return layer is not None and cfg.layer_pattern[int(layer[1])] in rule.kinds

    params = [r for r in _PARAMS if saved(r, path)]
    name, rule = _rename(path, params, to_hf=True, prefix=False)
    if name is not None:
        renames = [r for r in _RENAMES[family] + _COMMON_RENAMES if saved(r, name)]
        hf, _ = _rename(name, renames, to_hf=True, prefix=True, root=_ROOTS.get(family, "model"))
        if hf is not None:
            return hf, rule
    raise ValueError(f"no {family} checkpoint name for the parameter {path}")


def module_path_to_hf(cfg: HybridConfig, path: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """The inverse of :func:`hf_to_module_path`: the HF name and tensor of the parameter at
    module ``path`` (single-device layout), in the name and layout the family's checkpoints
    use, before gate/up and per-expert splitting (:func:`_split_for_hf`). ``ValueError``
    when no rule names it."""
    name, rule = _to_hf(cfg, path)
    return name, rule.transform.save(value)


def module_path_to_hf_name(cfg: HybridConfig, path: str) -> str:
    """The HF name of the parameter at module ``path`` (:func:`module_path_to_hf` without
    a value)."""
    return _to_hf(cfg, path)[0]


# Hub checkpoints store Nemotron-H's routed experts one by one:
# "backbone.layers.1.mixer.experts.7.up_proj.weight" [I, H] → "….experts.up_proj" [E, I, H].
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(\w+)$")


def _stack_experts(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Per-expert tensors stacked along a new leading expert axis (as transformers'
    conversion mapping does on load), and the errors found (missing or mis-shaped experts)."""
    stacked: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        found = _PER_EXPERT.match(name)
        if found is None:
            stacked[name] = tensor
        else:
            per_expert.setdefault(f"{found[1]}.{found[3]}", {})[int(found[2])] = tensor
    errors = []
    for name, experts in sorted(per_expert.items()):
        missing = sorted(set(range(max(experts) + 1)) - set(experts))
        shapes = {t.shape for t in experts.values()}
        if missing or len(shapes) > 1:
            errors.append(f"{name}: experts {missing} missing, expert shapes {sorted(shapes)}")
        else:
            stacked[name] = stack([experts[e] for e in range(len(experts))])
    return stacked, errors


_GATE = re.compile(r"^(.*)\.gate_proj\.(weight|bias)$")
_GATE_UP_NAME = re.compile(r"^(.*)\.gate_up_proj\.(weight|bias)$")


def _stack_gate_up(tensors: dict[str, LazyTensor]) -> tuple[dict[str, LazyTensor], list[str]]:
    """Each MLP's ``gate_proj`` and ``up_proj`` (weight ``[I, H]``, bias ``[I]``) stacked
    into one ``gate_up_proj`` (``[2, I, H]``, ``[2, I]``), the model's one ``gate_up``
    weight; and the errors found (a gate without its up, or of another shape)."""
    stacked, errors = dict(tensors), []
    for name, gate in tensors.items():
        found = _GATE.match(name)
        if found is None:
            continue
        up_name = f"{found[1]}.up_proj.{found[2]}"
        up = tensors.get(up_name)
        if up is None or up.shape != gate.shape:
            errors.append(f"{name} {gate.shape} needs {up_name} of its shape")
            continue
        del stacked[name], stacked[up_name]
        stacked[f"{found[1]}.gate_up_proj.{found[2]}"] = stack([gate, up])
    return stacked, errors


def _split_for_hf(name: str, tensor: np.ndarray) -> dict[str, np.ndarray]:
    """The inverse of :func:`_stack_gate_up` and :func:`_stack_experts` for one tensor:
    ``gate_up_proj`` [2, ...] → ``gate_proj`` and ``up_proj``; stacked experts
    ``experts.up_proj`` [E, ...] → ``experts.{e}.up_proj.weight``; others unchanged."""
    found = _GATE_UP_NAME.match(name)
    if found is not None:
        return {
            f"{found[1]}.gate_proj.{found[2]}": tensor[0],
            f"{found[1]}.up_proj.{found[2]}": tensor[1],
        }
    found = _STACKED_EXPERTS.match(name)
    if found is not None:
        return {f"{found[1]}.{e}.{found[2]}.weight": t for e, t in enumerate(tensor)}
    return {name: tensor}


def hf_tensors(model: HybridLM) -> dict[str, np.ndarray]:
    """Every tensor of ``model`` under its Hugging Face name, in the layout of the family's
    checkpoints (the inverse of what :func:`load_hf_checkpoint` does), as host arrays in
    the model's dtypes. A sharded model's parameters are gathered and put back from the
    tp-major layout (``flax_models.sharding.from_tp_layout``). The tied head has no tensor."""
    cfg, tp = model.cfg, tp_size(model.mesh)
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = tuple(map(str, path))
        value = from_tp_layout(names, _host(var[...]), cfg, tp)
        name, tensor = module_path_to_hf(cfg, ".".join(names), value)
        for key, part in _split_for_hf(name, tensor).items():
            if key in tensors:
                raise ValueError(f"two parameters save as {key}")
            tensors[key] = np.ascontiguousarray(part)
    return tensors


def _host(array: jax.Array) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) array, whole on the host."""
    if not array.is_fully_addressable:
        from jax.experimental import multihost_utils

        array = multihost_utils.process_allgather(array, tiled=True)
    return np.asarray(jax.device_get(array))


def _read_tensors(directory: Path) -> dict[str, LazyTensor]:
    """Every tensor of the directory's safetensors files, opened (nothing read yet)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {directory}")
    tensors: dict[str, LazyTensor] = {}
    for name in files:
        handle = safe_open(directory / name, framework="numpy")
        tensors.update({key: StoredTensor(handle, key) for key in handle.keys()})  # noqa: SIM118
    return tensors


def load_hf_checkpoint(
    directory: str | Path,
    *,
    dtype: jnp.dtype = jnp.float32,
    implementation: str = "auto",
    mesh: Mesh | None = None,
) -> HybridLM:
    """Builds a ``HybridLM`` from a Hugging Face directory (config.json + safetensors).

    With ``mesh`` (an axis ``"tp"`` and/or ``"dp"``), each parameter is built shard by shard
    (``jax.make_array_from_callback`` with its ``NamedSharding``, in the tp-major layout of
    ``flax_models.sharding``), as ``HybridLM(..., mesh=mesh)`` places them: each process
    reads the parts of the files its devices' shards hold, a replicated tensor once.

    Weights are cast to ``dtype`` except ``A_log``, ``D`` and ``dt_bias`` (fp32 always).
    Raises ``ValueError`` naming every missing, unexpected or mis-shaped tensor (with
    shapes), and ``NotImplementedError`` for unsupported families or options.
    """
    directory = Path(directory)
    cfg = HybridConfig.from_hf(json.loads((directory / "config.json").read_text()))
    mesh = with_tp_axis(mesh)  # a dp-only mesh: the specs name "tp" (of size 1)
    if mesh is not None:
        check_tp(cfg, tp_size(mesh))
    abstract = nnx.eval_shape(
        lambda: HybridLM(cfg, dtype=dtype, implementation=implementation, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    expected = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}
    filled: dict[str, LazyTensor] = {}
    tensors, errors = _stack_experts(_read_tensors(directory))
    tensors, gate_up_errors = _stack_gate_up(tensors)
    errors += gate_up_errors
    for name, tensor in sorted(tensors.items()):
        target = hf_to_module_path(cfg.family, name, tensor)
        if target is None:
            errors.append(f"unexpected tensor {name} {tensor.shape}")
            continue
        path, value = target
        if path not in expected:
            errors.append(f"unexpected tensor {name} {tensor.shape} (as {path})")
        elif value.shape != expected[path].shape:
            errors.append(
                f"tensor {name} has shape {tensor.shape}; {path} needs {expected[path].shape}"
            )
        else:
            filled[path] = value
    errors += [
        f"missing tensor for {path} {var.shape}"
        for path, var in expected.items()
        if path not in filled
    ]
    if errors:
        raise ValueError(
            f"checkpoint {directory} does not match {cfg.family} "
            f"({len(errors)} problems):\n  " + "\n  ".join(errors)
        )
    if mesh is None:
        flat = []
        for path, var in nnx.to_flat_state(state):
            value = np.asarray(filled[".".join(map(str, path))])
            flat.append((path, var.replace(jnp.asarray(value, var.dtype))))
        return nnx.merge(graphdef, nnx.from_flat_state(flat))
    graphdef = nnx.graphdef(
        nnx.eval_shape(
            lambda: HybridLM(
                cfg,
                dtype=dtype,
                implementation=implementation,
                rngs=nnx.Rngs(0),
                mesh=mesh,
                _unplaced=True,
            )
        )
    )
    tp, flat = tp_size(mesh), []
    for path, var in nnx.to_flat_state(state):
        names = tuple(map(str, path))
        value = tp_layout(names, filled[".".join(names)], cfg, tp)
        sharding = NamedSharding(mesh, param_spec(names, value.shape, tp))
        array = jax.make_array_from_callback(value.shape, sharding, _shard_reader(value, var.dtype))
        flat.append((path, var.replace(array)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _shard_reader(value: LazyTensor, dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback of ``jax.make_array_from_callback``: the shard at an index, read once
    per distinct index (devices holding copies of a shard share the read)."""
    read: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in read:
            read[key] = np.asarray(value.read(index)).astype(dtype)
        return read[key]

    return shard
