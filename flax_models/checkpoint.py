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
from flax_models.sharding import check_tp, param_spec, tp_layout, tp_size, with_tp_axis

# 1) Family prefixes: HF name prefix → module path prefix. First match wins.
_LAYER = r"^(?:backbone|model)\.layers\.(\d+)\."
_RENAMES: dict[str, list[tuple[str, str]]] = {
    "mamba2": [
        (r"^backbone\.embeddings\.", "embed."),
        (r"^backbone\.norm_f\.", "final_norm."),
        (_LAYER + r"norm\.", r"layers.\1.norm."),
        (_LAYER + r"mixer\.", r"layers.\1.mixer."),
    ],
    "bamba": [
        (r"^model\.embed_tokens\.", "embed."),
        (r"^model\.final_layernorm\.", "final_norm."),
        (_LAYER + r"input_layernorm\.", r"layers.\1.norm."),
        (_LAYER + r"(?:mamba|self_attn)\.", r"layers.\1.mixer."),
        (_LAYER + r"pre_ff_layernorm\.", r"layers.\1.mlp_norm."),
        (_LAYER + r"feed_forward\.", r"layers.\1.mlp."),
    ],
    "granitemoehybrid": [
        (r"^model\.embed_tokens\.", "embed."),
        (r"^model\.norm\.", "final_norm."),
        (_LAYER + r"input_layernorm\.", r"layers.\1.norm."),
        (_LAYER + r"(?:mamba|self_attn)\.", r"layers.\1.mixer."),
        (_LAYER + r"post_attention_layernorm\.", r"layers.\1.mlp_norm."),
        (_LAYER + r"shared_mlp\.", r"layers.\1.mlp."),
        (_LAYER + r"block_sparse_moe\.", r"layers.\1.moe."),  # routed experts, if any
    ],
}
_RENAMES["nemotron_h"] = _RENAMES["mamba2"]
# Falcon-H1: every layer holds both mixers side by side (ParallelHybridMixer), each under
# its own name, and the MLP after them.
_RENAMES["falcon_h1"] = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.final_layernorm\.", "final_norm."),
    (_LAYER + r"input_layernorm\.", r"layers.\1.norm."),
    (_LAYER + r"mamba\.", r"layers.\1.mixer.mamba."),
    (_LAYER + r"self_attn\.", r"layers.\1.mixer.attention."),
    (_LAYER + r"pre_ff_layernorm\.", r"layers.\1.mlp_norm."),
    (_LAYER + r"feed_forward\.", r"layers.\1.mlp."),
]
_COMMON_RENAMES = [(r"^lm_head\.", "lm_head.")]


def _linear(x: np.ndarray) -> np.ndarray:
    return x.T


def _conv(x: np.ndarray) -> np.ndarray:
    return x[:, 0, :]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _gate_up(x: np.ndarray) -> np.ndarray:
    """Gate and up stacked [2, I, H] → the MLP's ``gate_up`` kernel [H, 2, I]."""
    return x.transpose(2, 0, 1)


def _halves(x: np.ndarray) -> np.ndarray:
    """``x`` cut in two along its first axis, the halves stacked: [2n, ...] → [2, n, ...]."""
    return stack([x[: len(x) // 2], x[len(x) // 2 :]])


def _experts(x: np.ndarray) -> np.ndarray:
    """Stacked expert linears [E, out, in] → grouped-matmul weights [E, in, out]."""
    return x.transpose(0, 2, 1)


# 2) Parameter names: (suffix pattern, target suffix, transform).
_PARAMS: list[tuple[str, str, Callable]] = [
    # Mixture of experts (before the dense rules, which would also match these names).
    # Granite (block_sparse_moe → moe): experts fused as input_linear [E, 2I, H] (gate|up)
    # and output_linear [E, H, I]. Nemotron-H (mixer): router "gate", per-expert linears
    # stacked by _stack_experts into experts.up_proj [E, I, H] / experts.down_proj [E, H, I].
    (r"moe\.router\.layer\.weight$", "moe.router.kernel", _linear),
    (r"moe\.input_linear\.weight$", "moe.experts_up", _experts),
    (r"moe\.output_linear\.weight$", "moe.experts_down", _experts),
    (r"mixer\.gate\.weight$", "mixer.router.kernel", _linear),
    (r"mixer\.gate\.e_score_correction_bias$", "mixer.score_correction_bias", _same),
    (r"experts\.(up|down)_proj$", r"experts_\1", _experts),
    (r"shared_experts\.(up|down)_proj\.weight$", r"shared_expert.\1.kernel", _linear),
    (r"shared_experts\.(up|down)_proj\.bias$", r"shared_expert.\1.bias", _same),
    (r"embed\.weight$", "embed.embedding", _same),
    (r"(in_proj|out_proj|[qkvo]_proj)\.weight$", r"\1.kernel", _linear),
    (r"(in_proj|out_proj|[qkvo]_proj)\.bias$", r"\1.bias", _same),
    # Gated MLPs: gate_up_proj [2, I, H] is _stack_gate_up's, input_linear [2I, H] Granite's.
    (r"gate_up_proj\.weight$", "gate_up.kernel", _gate_up),
    (r"gate_up_proj\.bias$", "gate_up.bias", _same),
    (r"input_linear\.weight$", "gate_up.kernel", lambda x: _gate_up(_halves(x))),
    (r"(up|down)_proj\.weight$", r"\1.kernel", _linear),
    (r"(up|down)_proj\.bias$", r"\1.bias", _same),
    (r"output_linear\.weight$", "down.kernel", _linear),
    (r"conv1d\.weight$", "conv_weight", _conv),
    (r"conv1d\.bias$", "conv_bias", _same),
    (r"mixer\.norm\.weight$", "mixer.norm_weight", _same),
    (r"mamba\.norm\.weight$", "mamba.norm_weight", _same),  # Falcon-H1 with mamba_rms_norm
    (r"(A_log|D|dt_bias)$", r"\1", _same),
    (r"norm\.weight$", "norm.weight", _same),
    (r"lm_head\.weight$", "lm_head.kernel", _linear),
]


def hf_to_module_path(family: str, name: str, tensor: np.ndarray) -> tuple[str, np.ndarray] | None:
    """The module path and value one HF tensor fills, or None when no rule matches."""
    for pattern, prefix in _RENAMES[family] + _COMMON_RENAMES:
        if re.match(pattern, name):
            name = re.sub(pattern, prefix, name)
            break
    else:
        return None
    for pattern, target, transform in _PARAMS:
        found = re.search(pattern, name)
        if found is None:
            continue
        return name[: found.start()] + found.expand(target), transform(tensor)
    return None


# Hub checkpoints store Nemotron-H's routed experts one by one:
# "backbone.layers.1.mixer.experts.7.up_proj.weight" [I, H] → "….experts.up_proj" [E, I, H].
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


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
