"""``HybridConfig``: one layer-pattern string plus the options the hybrid families need.

The layer pattern spells one block per character, as Nemotron-H's
``hybrid_override_pattern`` does: ``M`` a Mamba2 mixer, ``*`` attention, ``-`` an MLP-only
block. Bamba and GraniteMoeHybrid put an MLP after every mixer (``mlp_per_layer``);
Mamba2 and Nemotron-H do not. Family differences are configuration, never code paths::

    family            pattern   mlp_per_layer  mlp             rope            multipliers
    mamba2            MMMM      False          -               -               -
    bamba             MM*M      True           SwiGLU          partial (0.5)   -
    granitemoehybrid  MM*M      True           SwiGLU (fused)  full or none    emb/res/attn/logits
    nemotron_h        M-M*      False          relu²           none            -
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

LayerKind = Literal["M", "*", "-"]
MlpActivation = Literal["silu", "relu2"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Architecture of a hybrid Mamba2/attention language model."""

    family: str  # checkpoint naming: "mamba2", "bamba", "granitemoehybrid", "nemotron_h"
    vocab_size: int
    hidden_size: int
    layer_pattern: str  # one of "M", "*", "-" per block
    mlp_per_layer: bool = False  # an MLP sub-block after every mixer (Bamba, Granite)
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Mamba2 mixer.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # Attention.
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    rope_theta: float | None = 10000.0  # None: no rotary embedding
    partial_rotary_factor: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # MLP.
    intermediate_size: int = 0
    mlp_activation: MlpActivation = "silu"  # "silu": gated (SwiGLU); "relu2": ungated
    mlp_bias: bool = False
    # Scalar multipliers (Granite).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by this

    def __post_init__(self):
        if not self.layer_pattern or set(self.layer_pattern) - set("M*-"):
            raise ValueError(f"layer_pattern={self.layer_pattern!r} must use only 'M', '*', '-'")
        if "M" in self.layer_pattern:
            if self.mamba_num_heads < 1 or self.mamba_head_dim < 1 or self.mamba_state_size < 1:
                raise ValueError(
                    "a pattern with 'M' needs mamba_num_heads, mamba_head_dim and "
                    "mamba_state_size >= 1"
                )
            if self.mamba_num_heads % self.mamba_groups:
                raise ValueError(f"{self.mamba_groups=} must divide {self.mamba_num_heads=}")
        if "*" in self.layer_pattern:
            if self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
                raise ValueError("a pattern with '*' needs num_heads, num_kv_heads, head_dim >= 1")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"{self.num_kv_heads=} must divide {self.num_heads=}")
        if ("-" in self.layer_pattern or self.mlp_per_layer) and self.intermediate_size < 1:
            raise ValueError("MLP blocks need intermediate_size >= 1")

    # Derived sizes ------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.mamba_d_inner + 2 * self.mamba_groups * self.mamba_state_size

    @property
    def mamba_in_proj_dim(self) -> int:
        """z, xBC and dt."""
        return self.mamba_d_inner + self.mamba_conv_dim + self.mamba_num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.rope_theta else 0

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    # Presets --------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> HybridConfig:
        """A tiny Bamba-style hybrid (random init) for tests and the demo."""
        fields = dict(
            family="bamba",
            vocab_size=256,
            hidden_size=64,
            layer_pattern="MM*M",
            mlp_per_layer=True,
            mamba_num_heads=8,
            mamba_head_dim=16,
            mamba_state_size=16,
            mamba_groups=2,
            mamba_chunk_size=16,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            intermediate_size=128,
        )
        return cls(**(fields | overrides))

    @classmethod
    def bamba_9b(cls, **overrides: Any) -> HybridConfig:
        """Bamba-9B's shape (random init, for benchmarks)."""
        pattern = "".join("*" if i in (9, 18, 27) else "M" for i in range(32))
        fields = dict(
            family="bamba",
            vocab_size=128256,
            hidden_size=4096,
            layer_pattern=pattern,
            mlp_per_layer=True,
            mamba_num_heads=128,
            mamba_head_dim=64,
            mamba_state_size=128,
            mamba_groups=1,
            mamba_chunk_size=256,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            partial_rotary_factor=0.5,
            intermediate_size=14336,
        )
        return cls(**(fields | overrides))

    # Hugging Face ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> HybridConfig:
        """Reads a Mamba2, Bamba, GraniteMoeHybrid (dense) or Nemotron-H (dense)
        ``config.json``; other families and MoE layers raise ``NotImplementedError``."""
        model_type = config.get("model_type")
        reader = _FROM_HF.get(model_type)
        if reader is None:
            raise NotImplementedError(
                f"model_type={model_type!r} is not supported; supported: {sorted(_FROM_HF)}"
            )
        return reader(config)


def _json_float(value: Any) -> float:
    """A float from config.json: plain, the string "Infinity", or transformers 5's
    ``{"__float__": "Infinity"}`` spelling of non-finite values."""
    if isinstance(value, Mapping):
        value = value["__float__"]
    return float(value)


def _time_step_limit(config: Mapping[str, Any]) -> tuple[float, float]:
    lo, hi = config.get("time_step_limit", (0.0, math.inf))
    return _json_float(lo), _json_float(hi)


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    rope = dict(config.get("rope_parameters") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise NotImplementedError(
            f"rope scaling {rope or config.get('rope_scaling')} is not supported"
        )
    return dict(rope_theta=float(theta), partial_rotary_factor=float(factor))


def _attention(config: Mapping[str, Any]) -> dict[str, Any]:
    heads = config["num_attention_heads"]
    return dict(
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        attention_bias=bool(config.get("attention_bias", False)),
    )


def _pattern(kinds: Sequence[str], names: Mapping[str, str]) -> str:
    try:
        return "".join(names[k] for k in kinds)
    except KeyError as e:
        raise NotImplementedError(f"layer type {e.args[0]!r} is not supported") from None


def _mamba2(config: Mapping[str, Any]) -> HybridConfig:
    hidden = config["hidden_size"]
    heads = config["num_heads"]
    head_dim = config.get("head_dim") or config.get("expand", 2) * hidden // heads
    return HybridConfig(
        family="mamba2",
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        layer_pattern="M" * config["num_hidden_layers"],
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=config.get("tie_word_embeddings", True),
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_size=config["state_size"],
        mamba_groups=config.get("n_groups", 1),
        mamba_conv_kernel=config.get("conv_kernel", 4),
        mamba_chunk_size=config.get("chunk_size", 256),
        mamba_conv_bias=config.get("use_conv_bias", True),
        mamba_proj_bias=config.get("use_bias", False),
        time_step_limit=_time_step_limit(config),
    )


def _bamba_like(config: Mapping[str, Any], *, family: str, pattern: str) -> dict[str, Any]:
    return dict(
        family=family,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        layer_pattern=pattern,
        mlp_per_layer=True,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        mamba_num_heads=config["mamba_n_heads"],
        mamba_head_dim=config["mamba_d_head"],
        mamba_state_size=config["mamba_d_state"],
        mamba_groups=config.get("mamba_n_groups", 1),
        mamba_conv_kernel=config.get("mamba_d_conv", 4),
        mamba_chunk_size=config.get("mamba_chunk_size", 256),
        mamba_conv_bias=config.get("mamba_conv_bias", True),
        mamba_proj_bias=config.get("mamba_proj_bias", False),
        time_step_limit=_time_step_limit(config),
        **_attention(config),
    )


def _bamba(config: Mapping[str, Any]) -> HybridConfig:
    attention = set(config.get("attn_layer_indices") or ())
    pattern = "".join("*" if i in attention else "M" for i in range(config["num_hidden_layers"]))
    return HybridConfig(
        **_bamba_like(config, family="bamba", pattern=pattern),
        **_rope(config),
        intermediate_size=config["intermediate_size"],
        mlp_bias=config.get("mlp_bias", False),
    )


def _granitemoehybrid(config: Mapping[str, Any]) -> HybridConfig:
    if config.get("num_local_experts", 0):
        raise NotImplementedError(
            f"GraniteMoeHybrid with num_local_experts={config['num_local_experts']} (MoE layers) "
            "is not supported; only the dense variant (num_local_experts == 0)"
        )
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
    pattern = _pattern(config["layer_types"], names)
    rope = config.get("position_embedding_type", "rope")
    rope_fields = _rope(config) if rope == "rope" else dict(rope_theta=None)
    return HybridConfig(
        **_bamba_like(config, family="granitemoehybrid", pattern=pattern),
        **rope_fields,
        intermediate_size=config["shared_intermediate_size"],
        attention_scale=config.get("attention_multiplier"),
        embedding_multiplier=config.get("embedding_multiplier", 1.0),
        residual_multiplier=config.get("residual_multiplier", 1.0),
        logits_scaling=config.get("logits_scaling", 1.0),
    )


def _nemotron_h(config: Mapping[str, Any]) -> HybridConfig:
    names = {
        "M": "M",
        "*": "*",
        "-": "-",
        "mamba": "M",
        "linear_attention": "M",
        "attention": "*",
        "full_attention": "*",
        "mlp": "-",
    }
    kinds = config.get("layers_block_type") or list(config["hybrid_override_pattern"])
    if any(k in ("E", "moe") for k in kinds):
        raise NotImplementedError("Nemotron-H MoE layers ('E' / 'moe') are not supported")
    activation = config.get("mlp_hidden_act", "relu2")
    if activation != "relu2":
        raise NotImplementedError(f"Nemotron-H mlp_hidden_act={activation!r} is not supported")
    return HybridConfig(
        family="nemotron_h",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        layer_pattern=_pattern(kinds, names),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=False,  # Nemotron-H never ties: lm_head is always saved
        mamba_num_heads=config["mamba_num_heads"],
        mamba_head_dim=config["mamba_head_dim"],
        mamba_state_size=config["ssm_state_size"],
        mamba_groups=config.get("n_groups", 1),
        mamba_conv_kernel=config.get("conv_kernel", 4),
        mamba_chunk_size=config.get("chunk_size", 256),
        mamba_conv_bias=config.get("use_conv_bias", True),
        mamba_proj_bias=config.get("use_bias", False),
        # Nemotron-H clamps dt to (time_step_min, inf); its time_step_limit is unused.
        time_step_limit=(_json_float(config.get("time_step_min", 0.0)), math.inf),
        **(_attention(config) | dict(attention_bias=False)),  # attention never has a bias
        rope_theta=None,
        intermediate_size=config["intermediate_size"],
        mlp_activation="relu2",
        mlp_bias=config.get("mlp_bias", False),
    )


_FROM_HF = {
    "mamba2": _mamba2,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
}
