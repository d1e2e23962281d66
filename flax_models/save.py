"""``HybridLM`` → a Hugging Face directory: the inverse of ``flax_models.checkpoint``.

``save_hf_checkpoint(model, directory)`` writes what transformers' ``save_pretrained``
writes: ``config.json``, the weights as safetensors under the family's tensor names (one
``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json`` once they pass ``max_shard_size``), and with
``tokenizer_from`` the tokenizer and generation files of another directory. The names and
layouts come from the loader's own table read backwards (``module_path_to_hf``), so a
checkpoint loaded from a Hugging Face directory saves back to the same tensors: names,
shapes, dtypes (loaded in the checkpoint's dtype) and values.

``config.json`` is the file the model's config was read from (``HybridConfig.hf_config``)
when it still describes the model, else one written from the config's fields
(:func:`hf_config_dict`), checked by reading it back with ``HybridConfig.from_hf``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from flax_models.checkpoint import hf_tensors
from flax_models.config import HybridConfig
from flax_models.model import HybridLM

# What transformers' tokenizers and ``GenerationConfig.save_pretrained`` write.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# config.json keys carried over from the original file when the config is rewritten.
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def parse_size(size: int | str) -> int:
    """Bytes: an int, or a string as transformers reads ``max_shard_size`` ("5GB" = 5·10⁹,
    "200MB", "2GiB" = 2·2³⁰, "1000")."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if found is None:
            raise ValueError(f"max_shard_size={size!r} must be bytes: an int or e.g. '5GB'")
        value = int(float(found[1]) * _UNITS[(found[2] or "").upper()])
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be at least one byte")
    return value


def save_hf_checkpoint(
    model: HybridLM,
    directory: str | Path,
    *,
    dtype: jnp.dtype | None = None,
    tokenizer_from: str | Path | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint that ``load_hf_checkpoint`` and
    transformers read back; returns the directory.

    Args:
      model: a ``HybridLM`` of any family the loader reads, on one device or a mesh (its
        shards are gathered; under several processes every process must call this, and
        process 0 writes).
      directory: created if missing; safetensors and index files already there are removed
        first (a stale shard would be read with the new ones).
      dtype: every floating tensor cast to it (e.g. ``jnp.bfloat16``); None keeps each
        tensor's own dtype (``A_log``, ``D``, ``dt_bias`` are fp32 in every model). The
        config's ``dtype`` names it, or the model's dtype.
      tokenizer_from: a directory whose tokenizer and generation files
        (:data:`TOKENIZER_FILES`, those present) are copied.
      max_shard_size: bytes per safetensors file (int or a string such as "5GB",
        "200MB"); tensors go into files in name order, a new file when the next tensor
        would pass it (a tensor larger than it gets a file of its own).

    Tied embeddings (``tie_word_embeddings``) save no ``lm_head.weight``.
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    cast = None if dtype is None else jnp.dtype(dtype)
    config = hf_config_dict(model.cfg, dtype=cast or model.dtype)
    tensors = hf_tensors(model)  # collective under several processes: everyone gathers
    if cast is not None:
        tensors = {
            k: t.astype(cast) if jnp.issubdtype(t.dtype, jnp.floating) else t
            for k, t in tensors.items()
        }
    if jax.process_index() != 0:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_shards(tensors, directory, limit)
    if tokenizer_from is not None:
        source = Path(tokenizer_from)
        if not source.is_dir():
            raise ValueError(f"tokenizer_from={str(source)!r} is not a directory")
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and (source / name).resolve() != (
                directory / name
            ).resolve():
                shutil.copyfile(source / name, directory / name)
    return directory


def _write_shards(tensors: dict[str, np.ndarray], directory: Path, limit: int) -> None:
    """``model.safetensors``, or numbered shards of at most ``limit`` bytes each (but for a
    tensor larger than that, alone in its shard) and the index naming each tensor's file."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}  # transformers reads files marked as PyTorch's
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], directory / "model.safetensors", metadata)
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(shard, directory / file, metadata)
        weight_map |= dict.fromkeys(shard, file)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ------------------------------------------------------------------------ config.json


def hf_config_dict(cfg: HybridConfig, *, dtype: jnp.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``: the file it was read from when that still describes
    it (``HybridConfig.hf_config``), else one written from its fields (keeping the original
    file's token ids), with ``dtype`` (or ``torch_dtype``, in older files) naming ``dtype``.

    ``ValueError`` when the family's config cannot express ``cfg`` (a layer kind or option
    its transformers model does not have), naming the fields that would not read back."""
    stored = cfg.hf_config
    if stored is not None and equivalent_configs(HybridConfig.from_hf(stored), cfg):
        config = json.loads(json.dumps(stored))  # a deep copy of plain JSON
    else:
        if cfg.family not in _TO_HF:
            raise ValueError(f"family={cfg.family!r} has no Hugging Face config; {sorted(_TO_HF)}")
        config = _TO_HF[cfg.family](cfg)
        config |= {k: stored[k] for k in _TOKEN_KEYS if stored and k in stored}
        back = HybridConfig.from_hf(config)
        if not equivalent_configs(back, cfg):
            fields = [f for f in _fields(cfg) if not _same_value(_fields(cfg)[f], _fields(back)[f])]
            raise ValueError(
                f"a {cfg.family} config.json cannot express this config: "
                + ", ".join(
                    f"{f}={_fields(cfg)[f]!r} reads back as {_fields(back)[f]!r}" for f in fields
                )
            )
    if dtype is not None:
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = jnp.dtype(dtype).name
    return config


# Fields that change nothing when the layers using them are absent: compared only then.
_MAMBA_FIELDS = tuple(
    f.name for f in dataclasses.fields(HybridConfig) if f.name.startswith("mamba_")
)
_GROUPS: dict[str, tuple[Callable[[HybridConfig], bool], tuple[str, ...]]] = {
    "mamba": (
        lambda c: bool(set("MP") & set(c.layer_pattern)),
        (*_MAMBA_FIELDS, "time_step_limit"),
    ),
    "attention": (
        lambda c: bool(set("*P") & set(c.layer_pattern)),
        (
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "attention_bias",
            "rope_theta",
            "partial_rotary_factor",
            "attention_scale",
            "key_multiplier",
            "attention_in_multiplier",
            "attention_out_multiplier",
        ),
    ),  # fmt: skip
    "moe": (
        lambda c: "E" in c.layer_pattern or c.moe_per_layer,
        (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "moe_activation",
            "moe_router",
            "norm_topk_prob",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "shared_expert_intermediate_size",
        ),
    ),  # fmt: skip
    "mlp": (
        lambda c: "-" in c.layer_pattern or c.mlp_per_layer,
        (
            "intermediate_size",
            "mlp_activation",
            "mlp_bias",
            "mlp_gate_multiplier",
            "mlp_down_multiplier",
        ),
    ),  # fmt: skip
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(HybridConfig)}


def _fields(cfg: HybridConfig) -> dict[str, Any]:
    """``cfg``'s fields that change the model: unused groups at their defaults, the
    implicit values spelled out (attention scale, Mamba2 out_proj bias)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare}
    if cfg.attention_scale is None and cfg.head_dim:
        fields["attention_scale"] = cfg.head_dim**-0.5
    fields["mamba_out_proj_bias"] = cfg.mamba_out_bias
    for used, names in _GROUPS.values():
        if not used(cfg):
            fields |= {name: _DEFAULTS[name] for name in names}
    return fields


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float | int):
        return a == b or math.isclose(a, b, rel_tol=1e-12)  # 1 / (1 / x) may move an ulp
    return a == b


def equivalent_configs(a: HybridConfig, b: HybridConfig) -> bool:
    """Whether two configs describe the same model: equal in every field that changes it
    (fields of absent layer kinds, e.g. the MLP's of a model with none, are not compared;
    an unset attention scale is ``head_dim ** -0.5``)."""
    fa, fb = _fields(a), _fields(b)
    return all(_same_value(fa[k], fb[k]) for k in fa)


def _time_step_limit(cfg: HybridConfig) -> list[float]:
    return [float(cfg.time_step_limit[0]), float(cfg.time_step_limit[1])]


def _mamba_fields(cfg: HybridConfig) -> dict[str, Any]:
    """The Mamba2 fields of Bamba, GraniteMoeHybrid and Falcon-H1."""
    expand = _expand(cfg, required=cfg.family != "falcon_h1")
    return (dict() if expand is None else dict(mamba_expand=expand)) | dict(
        mamba_n_heads=cfg.mamba_num_heads,
        mamba_d_head=cfg.mamba_head_dim,
        mamba_d_state=cfg.mamba_state_size,
        mamba_n_groups=cfg.mamba_groups,
        mamba_d_conv=cfg.mamba_conv_kernel,
        mamba_chunk_size=cfg.mamba_chunk_size,
        mamba_conv_bias=cfg.mamba_conv_bias,
        mamba_proj_bias=cfg.mamba_proj_bias,
        time_step_limit=_time_step_limit(cfg),
    )


def _expand(cfg: HybridConfig, *, required: bool = True) -> int | None:
    """``d_inner / hidden_size``, which transformers' configs hold as an int (``expand``,
    ``mamba_expand``; Mamba2, Bamba, Granite and Nemotron-H derive the mixer's width from
    it). Not an integer: ``ValueError`` where it is required, None (left out) where the
    family names the width itself (Falcon-H1's ``mamba_d_ssm``, Nemotron-H's heads × head_dim)."""
    expand, rest = divmod(cfg.mamba_d_inner, cfg.hidden_size)
    if rest == 0 and expand > 0:
        return expand
    if required:
        raise ValueError(
            f"a {cfg.family} config.json needs mamba_num_heads × mamba_head_dim = "
            f"{cfg.mamba_d_inner} to be a multiple of hidden_size={cfg.hidden_size}"
        )
    return None


def _attention_fields(cfg: HybridConfig) -> dict[str, Any]:
    return dict(
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        attention_bias=cfg.attention_bias,
    )


def _rope_fields(cfg: HybridConfig) -> dict[str, Any]:
    theta = 10000.0 if cfg.rope_theta is None else cfg.rope_theta
    return dict(
        rope_parameters=dict(
            rope_type="default", rope_theta=theta, partial_rotary_factor=cfg.partial_rotary_factor
        )
    )


def _common(cfg: HybridConfig, model_type: str, architecture: str) -> dict[str, Any]:
    return dict(
        architectures=[architecture],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def _mamba2(cfg: HybridConfig) -> dict[str, Any]:
    return _common(cfg, "mamba2", "Mamba2ForCausalLM") | dict(
        layer_norm_epsilon=cfg.norm_eps,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        expand=_expand(cfg),
        state_size=cfg.mamba_state_size,
        n_groups=cfg.mamba_groups,
        conv_kernel=cfg.mamba_conv_kernel,
        chunk_size=cfg.mamba_chunk_size,
        use_conv_bias=cfg.mamba_conv_bias,
        use_bias=cfg.mamba_proj_bias,
        time_step_limit=_time_step_limit(cfg),
    )


def _bamba(cfg: HybridConfig) -> dict[str, Any]:
    return (
        _common(cfg, "bamba", "BambaForCausalLM")
        | _mamba_fields(cfg)
        | _attention_fields(cfg)
        | _rope_fields(cfg)
        | dict(
            attn_layer_indices=[i for i, kind in enumerate(cfg.layer_pattern) if kind == "*"],
            rms_norm_eps=cfg.norm_eps,
            intermediate_size=cfg.intermediate_size,
            mlp_bias=cfg.mlp_bias,
            hidden_act="silu",
        )
    )


def _granitemoehybrid(cfg: HybridConfig) -> dict[str, Any]:
    kinds = {"M": "mamba", "*": "attention"}
    config = (
        _common(cfg, "granitemoehybrid", "GraniteMoeHybridForCausalLM")
        | _mamba_fields(cfg)
        | _attention_fields(cfg)
        | dict(
            layer_types=[kinds.get(kind, kind) for kind in cfg.layer_pattern],
            position_embedding_type="rope" if cfg.rope_theta else "nope",
            rms_norm_eps=cfg.norm_eps,
            shared_intermediate_size=cfg.intermediate_size,
            attention_multiplier=cfg.scale / cfg.key_multiplier,
            embedding_multiplier=cfg.embedding_multiplier,
            residual_multiplier=cfg.residual_multiplier,
            logits_scaling=cfg.logits_scaling,
            hidden_act="silu",
            num_local_experts=cfg.num_experts if cfg.moe_per_layer else 0,
            num_experts_per_tok=cfg.num_experts_per_tok if cfg.moe_per_layer else 0,
            intermediate_size=(
                cfg.moe_intermediate_size if cfg.moe_per_layer else cfg.intermediate_size
            ),
        )
    )
    return config | (_rope_fields(cfg) if cfg.rope_theta else {})


def _nemotron_h(cfg: HybridConfig) -> dict[str, Any]:
    moe = "E" in cfg.layer_pattern
    config = _common(cfg, "nemotron_h", "NemotronHForCausalLM") | dict(
        hybrid_override_pattern=cfg.layer_pattern,
        layer_norm_epsilon=cfg.norm_eps,
        mamba_num_heads=cfg.mamba_num_heads,
        mamba_head_dim=cfg.mamba_head_dim,
        ssm_state_size=cfg.mamba_state_size,
        n_groups=cfg.mamba_groups,
        conv_kernel=cfg.mamba_conv_kernel,
        chunk_size=cfg.mamba_chunk_size,
        use_conv_bias=cfg.mamba_conv_bias,
        use_bias=cfg.mamba_proj_bias,
        time_step_min=float(cfg.time_step_limit[0]),
        **_attention_fields(cfg),
        intermediate_size=cfg.intermediate_size,
        mlp_hidden_act="relu2",
        mlp_bias=cfg.mlp_bias,
    )
    expand = _expand(cfg, required=False)  # unused: the width is heads × head_dim
    if expand is not None:
        config["expand"] = expand
    if cfg.time_step_limit[1] != math.inf:  # Nemotron-H has no upper dt clamp
        config["time_step_max"] = cfg.time_step_limit[1]  # reads back as inf: flagged
    if moe:
        config |= dict(
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        )
    return config


def _falcon_h1(cfg: HybridConfig) -> dict[str, Any]:
    return (
        _common(cfg, "falcon_h1", "FalconH1ForCausalLM")
        | _mamba_fields(cfg)
        | _attention_fields(cfg)
        | _rope_fields(cfg)
        | dict(
            rms_norm_eps=cfg.norm_eps,
            mamba_d_ssm=cfg.mamba_d_inner,
            projectors_bias=cfg.mamba_out_bias,
            mamba_rms_norm=cfg.mamba_rms_norm,
            mamba_norm_before_gate=cfg.mamba_norm_before_gate,
            intermediate_size=cfg.intermediate_size,
            mlp_bias=cfg.mlp_bias,
            hidden_act="silu",
            embedding_multiplier=cfg.embedding_multiplier,
            lm_head_multiplier=1.0 / cfg.logits_scaling,
            ssm_in_multiplier=cfg.mamba_in_multiplier,
            ssm_out_multiplier=cfg.mamba_out_multiplier,
            ssm_multipliers=list(cfg.mamba_zxbcdt_multipliers),
            attention_in_multiplier=cfg.attention_in_multiplier,
            attention_out_multiplier=cfg.attention_out_multiplier,
            key_multiplier=cfg.key_multiplier,
            mlp_multipliers=[cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier],
        )
    )


_TO_HF: dict[str, Callable[[HybridConfig], dict[str, Any]]] = {
    "mamba2": _mamba2,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
}
