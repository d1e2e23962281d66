"""``HybridConfig``: one layer-pattern string plus the options the hybrid families need.

The layer pattern spells one block per character, as Nemotron-H's
``hybrid_override_pattern`` does: ``M`` a Mamba2 mixer, ``*`` attention, ``-`` an MLP-only
block, ``P`` attention and a Mamba2 mixer in parallel on the same input (Falcon-H1).
Bamba, GraniteMoeHybrid and Falcon-H1 put an MLP after every mixer (``mlp_per_layer``);
Mamba2 and Nemotron-H do not. Family differences are configuration, never code paths::

    family            pattern   mlp_per_layer  mlp             rope            multipliers
    mamba2            MMMM      False          -               -               -
    bamba             MM*M      True           SwiGLU          partial (0.5)   -
    granitemoehybrid  MM*M      True           SwiGLU (fused)  full or none    emb/res/attn/logits
    nemotron_h        M-M*      False          relu²           none            -
    falcon_h1         PPPP      True           SwiGLU          full            µP (see below)

Mixture of experts (``layers/moe.py``): ``E`` is a MoE block (Nemotron-H's ``moe``: sigmoid
router, relu² experts, one shared expert); GraniteMoeHybrid with experts runs routed SwiGLU
experts beside its per-layer MLP, which is its shared expert (``moe_per_layer``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

LayerKind = Literal["M", "*", "-", "P", "E"]
MlpActivation = Literal["silu", "relu2"]
MoeRouter = Literal["softmax", "sigmoid"]  # see flax_models/layers/moe.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Architecture of a hybrid Mamba2/attention language model."""

    # Checkpoint naming: "mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1".
    family: str
    vocab_size: int
    hidden_size: int
    layer_pattern: str  # one of "M", "*", "-", "P", "E" (MoE, Nemotron-H) per block
    mlp_per_layer: bool = False  # an MLP sub-block after every mixer (Bamba, Granite, Falcon-H1)
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
    # Mixture of experts (layers/moe.py): the mixer of 'E' blocks (Nemotron-H), and with
    # ``moe_per_layer`` routed experts beside the per-layer MLP (Granite MoE, whose
    # ``shared_mlp`` is that MLP).
    moe_per_layer: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0  # width of one routed expert
    moe_activation: MlpActivation = "silu"  # "silu": gated (fused gate|up); "relu2": ungated
    moe_router: MoeRouter = "softmax"
    norm_topk_prob: bool = True  # renormalise the k weights to sum to 1
    n_group: int = 1  # sigmoid router: experts in n_group groups, topk_group of them kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # scales the routed experts' weights
    shared_expert_intermediate_size: int = 0  # an always-on expert inside the MoE; 0: none
    # Scalar multipliers (Granite).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by this
    # µP multipliers and Mamba2 options of Falcon-H1. The defaults are neutral: other
    # families compute exactly what they did without these fields.
    mamba_in_multiplier: float = 1.0  # scales the Mamba2 mixer's input (ssm_in_multiplier)
    mamba_out_multiplier: float = 1.0  # scales the Mamba2 mixer's output (ssm_out_multiplier)
    # Per-segment scales of in_proj's output z | x | B | C | dt (ssm_multipliers).
    mamba_zxbcdt_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mamba_rms_norm: bool = True  # False: y · silu(z), no grouped RMSNorm (and no norm weight)
    mamba_norm_before_gate: bool = False  # True: rmsnorm(y) · silu(z); False: rmsnorm(y · silu(z))
    mamba_out_proj_bias: bool | None = None  # None: as mamba_proj_bias (Falcon-H1: projectors_bias)
    attention_in_multiplier: float = 1.0  # scales the attention's input
    attention_out_multiplier: float = 1.0  # scales the attention's output
    key_multiplier: float = 1.0  # scales the keys; applied through ``scale``
    mlp_gate_multiplier: float = 1.0  # gated MLP: silu(gate(x) · this) · up(x)
    mlp_down_multiplier: float = 1.0  # scales the MLP's output
    # The config.json this config was read from (``from_hf``), kept so that a loaded
    # checkpoint saves back the same file (``save_hf_checkpoint``); None for a config built
    # here. Not compared or hashed: two configs of the same architecture are equal.
    hf_config: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not self.layer_pattern or set(self.layer_pattern) - set("M*-PE"):
            raise ValueError(
                f"layer_pattern={self.layer_pattern!r} must use only 'M', '*', '-', 'P', 'E'"
            )
        if "E" in self.layer_pattern or self.moe_per_layer:
            self._check_moe()
        if set("MP") & set(self.layer_pattern):  # 'P' runs a Mamba2 mixer and attention
            if self.mamba_num_heads < 1 or self.mamba_head_dim < 1 or self.mamba_state_size < 1:
                raise ValueError(
                    "a pattern with 'M' needs mamba_num_heads, mamba_head_dim and "
                    "mamba_state_size >= 1"
                )
            if self.mamba_num_heads % self.mamba_groups:
                raise ValueError(f"{self.mamba_groups=} must divide {self.mamba_num_heads=}")
        if set("*P") & set(self.layer_pattern):
            if self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
                raise ValueError("a pattern with '*' needs num_heads, num_kv_heads, head_dim >= 1")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"{self.num_kv_heads=} must divide {self.num_heads=}")
        if ("-" in self.layer_pattern or self.mlp_per_layer) and self.intermediate_size < 1:
            raise ValueError("MLP blocks need intermediate_size >= 1")
        if len(self.mamba_zxbcdt_multipliers) != 5:
            raise ValueError(
                f"mamba_zxbcdt_multipliers={self.mamba_zxbcdt_multipliers} needs 5 values "
                "(z, x, B, C, dt)"
            )

    def _check_moe(self) -> None:
        E, k = self.num_experts, self.num_experts_per_tok
        if self.moe_per_layer and not self.mlp_per_layer:
            raise ValueError(
                "moe_per_layer puts experts beside the per-layer MLP: needs mlp_per_layer"
            )
        if E < 1 or not 1 <= k <= E or self.moe_intermediate_size < 1:
            raise ValueError(
                f"MoE layers need num_experts >= 1, 1 <= num_experts_per_tok <= num_experts and "
                f"moe_intermediate_size >= 1; got {E=}, {k=}, {self.moe_intermediate_size=}"
            )
        if self.n_group < 1 or E % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"{self.n_group=} must divide num_experts={E}, and 1 <= {self.topk_group=} "
                "<= n_group"
            )
        group = E // self.n_group
        if self.topk_group < self.n_group and (self.moe_router != "sigmoid" or group < 2):
            raise ValueError(
                "group-limited routing (topk_group < n_group) needs the sigmoid router and "
                f">= 2 experts per group; got moe_router={self.moe_router!r}, {group} per group"
            )
        if k > self.topk_group * group:
            raise ValueError(
                f"num_experts_per_tok={k} exceeds the {self.topk_group * group} "
                "experts of the kept groups"
            )

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
        """Softmax scale; ``(q · key_multiplier k) s = (q · k)(key_multiplier s)``, so the
        key multiplier is applied here, once, not to every key."""
        base = self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale
        return base * self.key_multiplier

    @property
    def mamba_out_bias(self) -> bool:
        """Whether the Mamba2 out_proj has a bias."""
        if self.mamba_out_proj_bias is None:
            return self.mamba_proj_bias
        return self.mamba_out_proj_bias

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

    @classmethod
    def tiny_moe(cls, **overrides: Any) -> HybridConfig:
        """A tiny Nemotron-H-style MoE hybrid (random init) for tests and the quick
        benchmark: Mamba2, MoE (sigmoid router, group-limited top-k) and attention blocks."""
        fields = dict(
            family="nemotron_h",
            vocab_size=256,
            hidden_size=64,
            layer_pattern="ME*E",
            mamba_num_heads=8,
            mamba_head_dim=16,
            mamba_state_size=16,
            mamba_groups=2,
            mamba_chunk_size=16,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=None,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_activation="relu2",
            moe_router="sigmoid",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            shared_expert_intermediate_size=48,
        )
        return cls(**(fields | overrides))

    @classmethod
    def nemotron3_nano_30b_a3b(cls, **overrides: Any) -> HybridConfig:
        """Nemotron 3 Nano 30B-A3B's shape (random init, for benchmarks): 52 blocks, 23
        Mamba2 (64 heads × 64, N = 128, G = 8, chunk 128), 23 MoE (128 relu² experts of
        width 1856, top-6, one shared expert of 3712), 6 attention (32 query / 2 KV heads
        × 128); about 32B parameters, 3.6B active per token."""
        fields = dict(
            family="nemotron_h",
            vocab_size=131072,
            hidden_size=2688,
            layer_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            mamba_num_heads=64,
            mamba_head_dim=64,
            mamba_state_size=128,
            mamba_groups=8,
            mamba_chunk_size=128,
            num_heads=32,
            num_kv_heads=2,
            head_dim=128,
            rope_theta=None,
            num_experts=128,
            num_experts_per_tok=6,
            moe_intermediate_size=1856,
            moe_activation="relu2",
            moe_router="sigmoid",
            routed_scaling_factor=2.5,
            shared_expert_intermediate_size=3712,
        )
        return cls(**(fields | overrides))

    @classmethod
    def nemotron_h_56b(cls, **overrides: Any) -> HybridConfig:
        """Nemotron-H-56B's shape (random init, for benchmarks; 112 GB in bf16, two GPUs):
        118 blocks: 54 Mamba2 (256 heads × 64, N = 256, G = 8, chunk 128), 54 relu² MLPs of
        width 32768 and 10 attention blocks (64 query / 8 KV heads × 128, no RoPE)."""
        fields = dict(
            family="nemotron_h",
            vocab_size=131072,
            hidden_size=8192,
            layer_pattern="M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-",
            mamba_num_heads=256,
            mamba_head_dim=64,
            mamba_state_size=256,
            mamba_groups=8,
            mamba_chunk_size=128,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=None,
            intermediate_size=32768,
            mlp_activation="relu2",
        )
        return cls(**(fields | overrides))

    @classmethod
    def granite_4_h_small(cls, **overrides: Any) -> HybridConfig:
        """Granite-4.0-H-Small's shape (random init, for benchmarks): 40 blocks, attention
        at 5, 15, 25, 35 (32 query / 8 KV heads × 128, no RoPE), Mamba2 elsewhere (128 heads
        × 64, N = 128, chunk 256), after every mixer 72 SwiGLU experts of width 768 (top-10)
        beside a shared SwiGLU MLP of width 1024; about 32B parameters, 9B active."""
        pattern = "".join("*" if i % 10 == 5 else "M" for i in range(40))
        fields = dict(
            family="granitemoehybrid",
            vocab_size=100352,
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
            rope_theta=None,
            intermediate_size=1024,
            moe_per_layer=True,
            num_experts=72,
            num_experts_per_tok=10,
            moe_intermediate_size=768,
            moe_activation="silu",
            moe_router="softmax",
        )
        return cls(**(fields | overrides))

    # Hugging Face ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> HybridConfig:
        """Reads a Mamba2, Bamba, GraniteMoeHybrid (dense or with experts), Nemotron-H (dense
        or with ``moe`` layers) or Falcon-H1 ``config.json``; other families raise
        ``NotImplementedError``."""
        model_type = config.get("model_type")
        reader = _FROM_HF.get(model_type)
        if reader is None:
            raise NotImplementedError(
                f"model_type={model_type!r} is not supported; supported: {sorted(_FROM_HF)}"
            )
        return dataclasses.replace(reader(config), hf_config=copy.deepcopy(dict(config)))


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


def _reject_unsupported(config: Mapping[str, Any], family: str, **defaults: Any) -> None:
    """``NotImplementedError`` naming the first of ``defaults``' fields that ``config`` sets
    to another value: options that change the computation and are not implemented."""
    for field, default in defaults.items():
        value = config.get(field, default)
        if value != default:
            raise NotImplementedError(
                f"{family} {field}={value!r} is not supported (only {default!r})"
            )


def _granite_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    """Granite-4.0-H Tiny/Small (``num_local_experts > 0``): routed SwiGLU experts (fused
    gate|up, width ``intermediate_size``) beside the shared MLP after every mixer; the router
    takes the softmax over the top-k logits (the top-k softmax weights, renormalised)."""
    experts = config.get("num_local_experts", 0)
    if not experts:  # dense: the shared MLP alone
        return {}
    return dict(
        moe_per_layer=True,
        num_experts=experts,
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["intermediate_size"],
        moe_activation="silu",
        moe_router="softmax",
        norm_topk_prob=True,
    )


def _nemotron_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    """Nemotron-H ``moe`` blocks (Nemotron 3 Nano): sigmoid router with score-correction
    bias, group-limited top-k, relu² experts without a gate, one shared expert. Absent
    fields take ``NemotronHConfig``'s defaults (transformers 5.23). ``n_shared_experts`` and
    ``moe_shared_expert_overlap`` change nothing there: one shared expert of width
    ``moe_shared_expert_intermediate_size`` always runs."""
    _reject_unsupported(
        config,
        "Nemotron-H",
        moe_latent_size=None,  # experts on a projected latent (fc1/fc2_latent_proj)
        num_nextn_predict_layers=0,  # multi-token-prediction layers (mtp.* weights)
    )
    return dict(
        num_experts=config.get("n_routed_experts", 8),
        num_experts_per_tok=config.get("num_experts_per_tok", 2),
        moe_intermediate_size=config.get("moe_intermediate_size", 7688),
        moe_activation="relu2",
        moe_router="sigmoid",
        norm_topk_prob=config.get("norm_topk_prob", True),
        n_group=config.get("n_group", 1),
        topk_group=config.get("topk_group", 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=config.get("moe_shared_expert_intermediate_size", 7688),
    )


def _granitemoehybrid(config: Mapping[str, Any]) -> HybridConfig:
    _reject_unsupported(config, "GraniteMoeHybrid", hidden_act="silu")
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
        **_granite_moe(config),
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
        "E": "E",
        "moe": "E",
    }
    kinds = config.get("layers_block_type") or list(config["hybrid_override_pattern"])
    _reject_unsupported(config, "Nemotron-H", mamba_hidden_act="silu")
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
        **_nemotron_moe(config),
    )


def _falcon_h1(config: Mapping[str, Any]) -> HybridConfig:
    """Falcon-H1: attention and a Mamba2 mixer in parallel in every layer (``P``), then an
    MLP, with µP multipliers everywhere. Absent fields take ``FalconH1Config``'s defaults
    (transformers 5.23), which differ from the other families' (e.g. ``mamba_d_ssm=1024``,
    ``mamba_rms_norm=False``, ``mamba_norm_before_gate=True``)."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":  # the MLP and the Mamba2 conv activation both use hidden_act
        raise NotImplementedError(f"Falcon-H1 hidden_act={activation!r} is not supported")
    hidden = config["hidden_size"]
    heads = config.get("mamba_n_heads", 128)
    d_ssm = config.get("mamba_d_ssm", 1024) or int(config.get("mamba_expand", 2) * hidden)
    head_dim = config.get("mamba_d_head", "auto")
    head_dim = d_ssm // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != d_ssm:
        raise ValueError(f"Falcon-H1 {heads=} × {head_dim=} must equal mamba_d_ssm={d_ssm}")
    gate_multiplier, down_multiplier = config.get("mlp_multipliers") or (1.0, 1.0)
    attention = _attention(config)
    if "num_key_value_heads" not in config:
        attention["num_kv_heads"] = 8  # FalconH1Config's default (None: num_attention_heads)
    return HybridConfig(
        family="falcon_h1",
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        layer_pattern="P" * config["num_hidden_layers"],
        mlp_per_layer=True,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_size=config.get("mamba_d_state", 256),
        mamba_groups=config.get("mamba_n_groups", 1),
        mamba_conv_kernel=config.get("mamba_d_conv", 4),
        mamba_chunk_size=config.get("mamba_chunk_size", 256),
        mamba_conv_bias=config.get("mamba_conv_bias", True),
        mamba_proj_bias=config.get("mamba_proj_bias", False),
        mamba_out_proj_bias=config.get("projectors_bias", False),
        mamba_rms_norm=config.get("mamba_rms_norm", False),
        mamba_norm_before_gate=config.get("mamba_norm_before_gate", True),
        time_step_limit=_time_step_limit(config),
        **attention,
        # Falcon-H1's default RoPE rotates the whole head whatever partial_rotary_factor says.
        **(_rope(config) | dict(partial_rotary_factor=1.0)),
        intermediate_size=config["intermediate_size"],
        mlp_bias=config.get("mlp_bias", False),
        embedding_multiplier=config.get("embedding_multiplier", 1.0),
        logits_scaling=1.0 / config.get("lm_head_multiplier", 1.0),
        mamba_in_multiplier=config.get("ssm_in_multiplier", 1.0),
        mamba_out_multiplier=config.get("ssm_out_multiplier", 1.0),
        mamba_zxbcdt_multipliers=tuple(config.get("ssm_multipliers") or (1.0,) * 5),
        attention_in_multiplier=config.get("attention_in_multiplier", 1.0),
        attention_out_multiplier=config.get("attention_out_multiplier", 1.0),
        key_multiplier=config.get("key_multiplier", 1.0),
        mlp_gate_multiplier=gate_multiplier,
        mlp_down_multiplier=down_multiplier,
    )


_FROM_HF = {
    "mamba2": _mamba2,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
}
