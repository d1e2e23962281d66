"""Hugging Face parity: every family's logits against golden logits from transformers.

Fixtures (tests/fixtures/<family>/: config.json, model.safetensors, golden.npz) come from
tools/make_hf_fixtures.py (transformers 5.23.0, torch 2.13.0 CPU); CI needs no torch.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from flax_models.batch import make_forward_batch
from flax_models.cache import init_cache
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.config import HybridConfig
from flax_models.layers import linear
from flax_models.layers import norm as norm_layer
from flax_models.layers.mlp import MLP
from flax_models.layers.moe import MoE
from flax_models.model import HybridLM, layer_implementation
from pallas_kernels.testing import assert_close
from tests.helpers import equations, pallas_call_counts

FIXTURES = Path(__file__).parent.parent / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").exists())
# Pallas kernels run in interpret mode on CPU: a short prefix keeps them quick, and the
# models are causal, so the prefix's logits are the golden logits' prefix.
TRITON_PREFIX = 12


def golden(family: str) -> tuple[jax.Array, np.ndarray]:
    data = np.load(FIXTURES / family / "golden.npz")
    return jnp.asarray(data["input_ids"]), data["logits"]


def test_every_family_has_a_fixture():
    assert {"mamba2", "bamba", "granitemoehybrid", "nemotronh"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_xla_fp32_matches_transformers(family):
    ids, expected = golden(family)
    model = load_hf_checkpoint(FIXTURES / family, implementation="xla")
    assert_close(jax.jit(model.__call__)(ids), expected, rtol=1e-4, name=f"{family} logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_matches_transformers(family):
    ids, expected = golden(family)
    model = load_hf_checkpoint(FIXTURES / family, implementation="triton")
    logits = model(ids[:, :TRITON_PREFIX])
    assert_close(logits, expected[:, :TRITON_PREFIX], rtol=1e-3, name=f"{family} logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_stays_close_and_keeps_ssm_parameters_fp32(family):
    ids, expected = golden(family)
    model = load_hf_checkpoint(FIXTURES / family, dtype=jnp.bfloat16, implementation="xla")
    for block in model.layers:
        if block.kind == "M":
            for p in (block.mixer.A_log, block.mixer.D, block.mixer.dt_bias):
                assert p[...].dtype == jnp.float32
            assert block.mixer.in_proj.kernel[...].dtype == jnp.bfloat16
    assert_close(model(ids), expected, rtol=2e-2, name=f"{family} bf16 logits")


def _copy_fixture(family: str, tmp_path: Path) -> Path:
    target = tmp_path / family
    shutil.copytree(FIXTURES / family, target)
    return target


def test_sharded_checkpoint_with_index(tmp_path):
    directory = _copy_fixture("bamba", tmp_path)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    ids, expected = golden("bamba")
    model = load_hf_checkpoint(directory, implementation="xla")
    assert_close(model(ids), expected, rtol=1e-4, name="sharded bamba logits")


def test_mixed_dtypes_on_disk(tmp_path):
    """bf16 weights with fp32 A_log/D/dt_bias, as Hub checkpoints ship them."""
    directory = _copy_fixture("granitemoehybrid", tmp_path)
    tensors = load_file(directory / "model.safetensors")
    keep_fp32 = ("A_log", "D", "dt_bias")
    mixed = {k: v if k.endswith(keep_fp32) else v.astype(jnp.bfloat16) for k, v in tensors.items()}
    save_file(mixed, directory / "model.safetensors")
    ids, expected = golden("granitemoehybrid")
    model = load_hf_checkpoint(directory, implementation="xla")
    assert_close(model(ids), expected, rtol=2e-2, name="mixed-dtype granite logits")


def _rewrite(directory: Path, change) -> None:
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_wrong_shape_tensor_is_named_with_both_shapes(tmp_path):
    directory = _copy_fixture("mamba2", tmp_path)
    name = "backbone.layers.1.mixer.out_proj.weight"

    def change(t):
        t[name] = t[name][:, :-1]

    _rewrite(directory, change)
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.mixer\.out_proj\.weight has shape "
        r"\(64, 127\); layers\.1\.mixer\.out_proj\.kernel "
        r"needs \(128, 64\)",
    ):
        load_hf_checkpoint(directory)


def test_missing_and_unexpected_tensors_are_all_reported(tmp_path):
    directory = _copy_fixture("nemotronh", tmp_path)

    def change(t):
        del t["backbone.layers.0.mixer.D"]
        t["backbone.layers.0.mixer.extra"] = np.zeros((3,), np.float32)

    _rewrite(directory, change)
    with pytest.raises(ValueError) as info:
        load_hf_checkpoint(directory)
    message = str(info.value)
    assert "missing tensor for layers.0.mixer.D (12,)" in message
    assert "unexpected tensor backbone.layers.0.mixer.extra (3,)" in message


HUB_CONFIGS = {
    "granite_hub_layer_names": (
        dict(
            model_type="granitemoehybrid",
            vocab_size=32,
            hidden_size=16,
            layer_types=["mamba", "attention", "mamba"],
            num_attention_heads=2,
            num_key_value_heads=1,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=4,
            mamba_n_groups=1,
            shared_intermediate_size=24,
            num_local_experts=0,
            position_embedding_type="nope",
            time_step_limit=[0.0, math.inf],
        ),
        "M*M",
    ),
    "nemotron_hub_pattern": (
        dict(
            model_type="nemotron_h",
            vocab_size=32,
            hidden_size=16,
            hybrid_override_pattern="M-M*-",
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=4,
            n_groups=1,
            intermediate_size=24,
        ),
        "M-M*-",
    ),
    "bamba_attention_indices": (
        dict(
            model_type="bamba",
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=4,
            attn_layer_indices=[2],
            num_attention_heads=2,
            num_key_value_heads=1,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=4,
            intermediate_size=24,
        ),
        "MM*M",
    ),
}


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_hub_style_configs(name):
    config, pattern = HUB_CONFIGS[name]
    cfg = HybridConfig.from_hf(config)
    assert cfg.layer_pattern == pattern
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.shape == (1, 5, 32) and np.all(np.isfinite(logits))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(model_type="llama"), "model_type='llama' is not supported"),
        # MoE options that change the computation and are not implemented (tests at the end).
        (dict(HUB_CONFIGS["nemotron_hub_pattern"][0], moe_latent_size=8), "moe_latent_size=8"),
        (
            dict(HUB_CONFIGS["nemotron_hub_pattern"][0], num_nextn_predict_layers=1),
            "num_nextn_predict_layers=1",
        ),
        (
            dict(HUB_CONFIGS["nemotron_hub_pattern"][0], mamba_hidden_act="gelu"),
            "mamba_hidden_act='gelu'",
        ),
        (
            dict(HUB_CONFIGS["granite_hub_layer_names"][0], hidden_act="gelu"),
            "hidden_act='gelu'",
        ),
    ],
)
def test_unsupported_configs_raise_not_implemented(config, match):
    with pytest.raises(NotImplementedError, match=match):
        HybridConfig.from_hf(config)


def test_tiny_preset_runs_and_is_causal():
    model = HybridLM(HybridConfig.tiny(), implementation="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (2, 19), 0, 256)
    logits = model(ids)
    changed = model(ids.at[:, 10:].set(7))
    np.testing.assert_allclose(
        np.asarray(logits[:, :10]), np.asarray(changed[:, :10]), rtol=1e-5, atol=1e-5
    )


def test_model_implementation_names_a_backend_family():
    assert layer_implementation("mosaic") == ("mosaic", "triton")
    for name in ("auto", "xla", "triton"):
        assert layer_implementation(name) == name
    assert layer_implementation(["triton", "xla"]) == ("triton", "xla")
    for bad in ("cuda", (), ("mosaic", "cuda")):
        with pytest.raises(ValueError, match="implementation"):
            layer_implementation(bad)


def test_mosaic_model_runs_triton_where_mosaic_has_no_kernel():
    """ "mosaic" is the Mosaic family: Mosaic kernels where an op has them, Triton elsewhere
    (causal_conv1d has no Mosaic kernel). Off-Hopper that is Triton, in interpret mode on a
    CPU, with the reference's logits."""
    cfg = HybridConfig.tiny(layer_pattern="M*")  # one of each stateful layer: quick
    ids = jax.random.randint(jax.random.key(1), (1, 7), 0, cfg.vocab_size)
    mosaic = HybridLM(cfg, implementation="mosaic", rngs=nnx.Rngs(0))
    xla = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    assert mosaic.layers[0].mixer.implementation == ("mosaic", "triton")
    assert_close(
        jax.jit(mosaic.__call__)(ids),
        jax.jit(xla.__call__)(ids),
        rtol=1e-5,
        name="mosaic-family logits",
    )


def test_residual_adds_run_in_the_next_norms_kernel():
    """On Pallas kernels each residual add runs inside the following RMSNorm's kernel (one
    launch where XLA takes three): every norm but the first block's, the final one
    included, is an ``add_rms_norm`` kernel; an xla model has none; the logits are the xla
    model's (``test_triton_matches_transformers`` checks them against Transformers)."""
    cfg = HybridConfig.tiny(layer_pattern="M*")  # one of each stateful layer, each with an MLP
    ids = jax.random.randint(jax.random.key(2), (2, 5), 0, cfg.vocab_size)
    logits = {}
    for impl in ("triton", "xla"):
        model = HybridLM(cfg, implementation=impl, rngs=nnx.Rngs(0))
        jaxpr = jax.make_jaxpr(model._dense)(ids).jaxpr
        counts = pallas_call_counts(jaxpr)
        fused = sum(n for name, n in counts.items() if name.startswith("add_rms_norm"))
        assert fused == (2 * len(cfg.layer_pattern) if impl == "triton" else 0)
        logits[impl] = jax.jit(model.__call__)(ids)
    assert_close(logits["triton"], logits["xla"], rtol=1e-5, name="logits")


def test_a_preference_takes_the_norm_kernel_up_to_its_row_limit():
    """``"triton"`` runs the add-and-norm kernel at any size; a preference (a model on
    ``"auto"`` or ``"mosaic"``) up to ``KERNEL_MAX_ROWS`` rows and XLA's add and norm above
    (where an earlier measurement found the kernel slower), the same numbers either way."""
    limit = norm_layer.KERNEL_MAX_ROWS
    for impl, rows, kernels in (
        (("mosaic", "triton"), limit, 1),
        (("mosaic", "triton"), limit + 1, 0),
        ("triton", limit + 1, 1),
    ):
        norm = norm_layer.RMSNorm(16, eps=1e-5, implementation=impl)
        x, residual = jax.random.normal(jax.random.key(rows), (2, 1, rows, 16))
        jaxpr = jax.make_jaxpr(norm)(x, residual).jaxpr
        assert sum(pallas_call_counts(jaxpr).values()) == kernels, (impl, rows)
        y, total = norm(x, residual)
        assert y.shape == total.shape == x.shape
        np.testing.assert_array_equal(total, x + residual)
        reference = norm_layer.RMSNorm(16, eps=1e-5, implementation="xla")(x + residual)
        assert_close(y, reference, rtol=1e-6, name=f"{impl} {rows} rows")
    # A name is a demand at any size: a backend the op lacks is refused, not swapped.
    x = jnp.ones((limit + 1, 16))
    with pytest.raises(ValueError, match="'mosaic' is not available for rms_norm"):
        norm_layer.RMSNorm(16, eps=1e-5, implementation="mosaic")(x, x)


def test_one_row_products_stay_gemms():
    """XLA's GPU simplifier turns a vector-matrix product of under 10M elements into a
    multiply and a reduction that write x · W out and read it back (bf16 products, three
    times the weight's bytes); a one-row step's projections therefore take two rows (the
    second zero) and keep the first: a one-token forward holds no one-row product, its
    logits are the same as one token among several, and a weight past the threshold is
    left alone (no pad)."""
    cfg = HybridConfig.tiny(layer_pattern="M*-")  # Mamba, attention, MLP; tied head
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (1, 3), 0, cfg.vocab_size)
    jaxpr = jax.make_jaxpr(model._dense)(ids[:, :1]).jaxpr
    weights = {p.shape for p in jax.tree.leaves(nnx.state(model, nnx.Param)) if p.ndim > 1}
    weights |= {shape[::-1] for shape in weights}  # the tied head reads the table transposed
    lhs_rows = [
        eqn.invars[0].aval.shape[:-1]
        for eqn in equations(jaxpr, "dot_general")
        if eqn.invars[1].aval.shape in weights
    ]
    assert len(lhs_rows) >= 6 and all(math.prod(rows) == 2 for rows in lhs_rows), lhs_rows
    assert_close(
        jax.jit(model._dense)(ids[:, :1])[0, 0],
        jax.jit(model._dense)(ids)[0, 0],
        rtol=1e-5,
        name="one token against the first of three",
    )
    x = jax.random.normal(jax.random.key(4), (1, 1, 8))
    w = jax.random.normal(jax.random.key(5), (8, 3))
    product = lambda rows: rows @ w  # noqa: E731
    assert_close(linear.as_gemm(product, x, w.size), x @ w, rtol=1e-6, name="padded row")
    big = linear.STRENGTH_REDUCED_ELEMENTS
    for size, rows in ((w.size, 2), (big, 1)):
        jaxpr = jax.make_jaxpr(lambda x, size=size: linear.as_gemm(product, x, size))(x)
        (dot,) = equations(jaxpr.jaxpr, "dot_general")
        assert math.prod(dot.invars[0].aval.shape[:-1]) == rows, size


def test_token_ids_outside_the_vocabulary_are_rejected():
    model = HybridLM(HybridConfig.tiny(), implementation="xla", rngs=nnx.Rngs(0))
    for ids in ([[1, 2, 256]], [[-1, 2, 3]]):
        with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=256\)"):
            model(jnp.asarray(ids))
    with pytest.raises(ValueError, match="integer"):
        model(jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        model(jnp.ones((3,), jnp.int32))


def test_empty_inputs_give_empty_logits():
    model = HybridLM(HybridConfig.tiny(), implementation="xla", rngs=nnx.Rngs(0))
    for shape in ((2, 0), (0, 5)):
        logits = model(jnp.zeros(shape, jnp.int32))
        assert logits.shape == (*shape, 256) and logits.dtype == jnp.float32
    assert jax.jit(model.__call__)(jnp.zeros((3, 0), jnp.int32)).shape == (3, 0, 256)


def test_a_slot_outside_the_cache_is_padding_in_every_layer():
    """Slot ids outside [0, S) read and write nothing (DESIGN §8), in the Mamba mixer too: a
    continuing sequence there starts from no state, even with every cache line NaN."""
    cfg = HybridConfig.tiny()
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    num_slots, length = 2, 8
    lengths, computed, slots = [5, 3, 4], [0, 2, 0], [0, num_slots, 1]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = jax.random.randint(jax.random.key(2), (int(qsl[-1]),), 0, cfg.vocab_size)
    caches = jax.tree.map(
        lambda c: jnp.full_like(c, jnp.nan),
        init_cache(cfg, num_slots=num_slots, max_len=length),
    )

    @jax.jit
    def forward(tokens, qsl, computed, slots, caches):
        batch = make_forward_batch(
            qsl, computed, slots, num_tokens=tokens.shape[0], chunk_size=cfg.mamba_chunk_size
        )
        return model.forward(tokens, batch, caches)

    logits, _ = forward(tokens, qsl, np.asarray(computed, np.int32), np.asarray(slots), caches)
    assert np.isfinite(np.asarray(logits)).all()
    # The padding sequence changes nothing for the others: same logits without it.
    alone = np.asarray(model(tokens[None, :5]))[0]
    assert_close(logits[:5], alone, rtol=1e-5, name="sequence beside a padding one")


# --- Falcon-H1: attention and Mamba2 in parallel in every layer ('P'), µP multipliers ---------

# A Hub-style Falcon-H1 config.json, shrunk: transformers 4 spelling (rope_theta at the top
# level, rope_scaling null) and keys the 5.23 modeling ignores (mamba_use_mlp,
# attn_layer_indices, num_logits_to_keep).
FALCON_HUB = dict(
    model_type="falcon_h1",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    mamba_d_ssm=16,
    mamba_n_heads=4,
    mamba_d_head=4,
    mamba_d_state=4,
    mamba_n_groups=1,
    mamba_chunk_size=4,
    mamba_rms_norm=False,
    mamba_norm_before_gate=False,
    mamba_use_mlp=True,
    attn_layer_indices=None,
    num_logits_to_keep=1,
    rope_theta=1e11,
    rope_scaling=None,
    time_step_limit=[0.0, math.inf],
    embedding_multiplier=5.0,
    lm_head_multiplier=0.25,
    key_multiplier=0.5,
    ssm_multipliers=[0.5, 0.25, 0.5, 0.5, 1.0],
    mlp_multipliers=[0.5, 0.25],
)


def test_falcon_h1_has_fixtures():
    assert {"falcon_h1", "falcon_h1_norm"} <= set(FAMILIES)


def test_falcon_h1_hub_config():
    cfg = HybridConfig.from_hf(FALCON_HUB)
    assert (cfg.layer_pattern, cfg.mlp_per_layer, cfg.family) == ("PPP", True, "falcon_h1")
    assert (cfg.mamba_d_inner, cfg.rope_theta, cfg.rotary_dim) == (16, 1e11, 8)
    assert cfg.logits_scaling == 4.0 and not cfg.mamba_rms_norm
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    assert model.layers[0].mixer.mamba.norm_weight is None  # mamba_rms_norm=False: no norm
    logits = jax.jit(model.__call__)(jnp.zeros((1, 5), jnp.int32))
    assert logits.shape == (1, 5, 32) and np.all(np.isfinite(logits))


def test_falcon_h1_absent_fields_take_the_transformers_defaults():
    """FalconH1Config's defaults (5.23) are not the other families': mamba_d_ssm 1024,
    128 heads of 8, state 256, 8 KV heads, no gated norm (norm before gate if on), and
    Falcon-H1's default RoPE turns the whole head whatever partial_rotary_factor says."""
    cfg = HybridConfig.from_hf(
        dict(
            model_type="falcon_h1",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=16,
            rope_parameters=dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5),
        )
    )
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size) == (128, 8, 256)
    assert (cfg.num_kv_heads, cfg.mamba_rms_norm, cfg.mamba_norm_before_gate) == (8, False, True)
    assert (cfg.partial_rotary_factor, cfg.rope_theta) == (1.0, 100.0)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
        (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), NotImplementedError, "rope"),
        (
            dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
            NotImplementedError,
            "rope",
        ),
        (dict(mamba_d_head=3), ValueError, "mamba_d_ssm=16"),
    ],
)
def test_falcon_h1_unsupported_or_inconsistent_fields_raise(change, error, match):
    with pytest.raises(error, match=match):
        HybridConfig.from_hf(FALCON_HUB | change)


def test_falcon_h1_bf16_keeps_ssm_parameters_fp32():
    model = load_hf_checkpoint(FIXTURES / "falcon_h1", dtype=jnp.bfloat16, implementation="xla")
    for block in model.layers:
        mamba = block.mixer.mamba
        for p in (mamba.A_log, mamba.D, mamba.dt_bias):
            assert p[...].dtype == jnp.float32
        assert mamba.in_proj.kernel[...].dtype == jnp.bfloat16
        assert block.mixer.attention.q_proj.kernel[...].dtype == jnp.bfloat16


def test_falcon_h1_layer_caches_hold_both_states():
    cfg = HybridConfig.from_hf(FALCON_HUB)
    caches = init_cache(cfg, num_slots=3, max_len=10)
    assert len(caches) == 3
    for cache in caches:
        assert cache.mamba.ssm_state.shape == (3, 4, 4, 4)
        assert cache.mamba.conv_state.shape == (3, 3, cfg.mamba_conv_dim)
        assert cache.attention.k.shape == cache.attention.v.shape == (3, 10, 1, 8)


# --- Mixture of experts: GraniteMoeHybrid with experts, Nemotron-H 'E' blocks ------------------

MOE_FAMILIES = ("granitemoehybrid_moe", "nemotronh_moe")

# Hub-style MoE config.json files, shrunk: Granite-4.0-H Tiny (layer names "mamba"/"attention",
# routed experts of width intermediate_size beside the shared MLP) and Nemotron 3 Nano (the
# legacy hybrid_override_pattern, group-free sigmoid routing, fields 5.23 ignores).
MOE_HUB_CONFIGS = {
    "granite_tiny": (
        dict(
            HUB_CONFIGS["granite_hub_layer_names"][0],
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=8,
            router_aux_loss_coef=0.0,
        ),
        "M*M",
    ),
    "nemotron_nano": (
        dict(
            HUB_CONFIGS["nemotron_hub_pattern"][0],
            hybrid_override_pattern="MEM*E",
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            moe_shared_expert_intermediate_size=12,
            n_shared_experts=1,
            moe_shared_expert_overlap=False,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_theta=10000,
        ),
        "MEM*E",
    ),
}


def test_moe_families_have_fixtures():
    assert set(MOE_FAMILIES) <= set(FAMILIES)


def test_moe_fixtures_build_the_moe_layers():
    granite = load_hf_checkpoint(FIXTURES / "granitemoehybrid_moe", implementation="xla")
    assert granite.cfg.moe_per_layer and granite.cfg.moe_router == "softmax"
    for block in granite.layers:  # routed experts beside the shared MLP in every layer
        assert block.moe.experts_up[...].shape == (8, 64, 2 * 24)  # [E, K, gate|up]
        assert block.moe.experts_down[...].shape == (8, 24, 64)
        assert block.moe.shared_expert is None and block.moe.score_correction_bias is None
    nemotron = load_hf_checkpoint(FIXTURES / "nemotronh_moe", implementation="xla")
    cfg = nemotron.cfg
    assert (cfg.layer_pattern, cfg.moe_router, cfg.n_group, cfg.topk_group) == (
        "MEM*E-",
        "sigmoid",
        2,
        1,
    )
    for i in (1, 4):
        moe = nemotron.layers[i].mixer
        assert moe.experts_up[...].shape == (8, 64, 32)
        assert moe.shared_expert.up.kernel[...].shape == (64, 48)
        assert np.any(np.asarray(moe.score_correction_bias[...]) != 0)


@pytest.mark.parametrize("name", sorted(MOE_HUB_CONFIGS))
def test_moe_hub_style_configs(name):
    config, pattern = MOE_HUB_CONFIGS[name]
    cfg = HybridConfig.from_hf(config)
    assert cfg.layer_pattern == pattern and cfg.num_experts in (4, 8)
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.shape == (1, 5, 32) and np.all(np.isfinite(logits))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(num_experts=0), "num_experts >= 1"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok <= num_experts"),
        (dict(n_group=3), "must divide num_experts=8"),
        (dict(topk_group=3), "topk_group"),
        (dict(moe_router="softmax"), "group-limited routing"),
        (dict(num_experts_per_tok=5), "exceeds the 4 experts of the kept groups"),
    ],
)
def test_inconsistent_moe_settings_are_rejected(change, match):
    fields = dict(_moe_config("sigmoid").__dict__) | change
    with pytest.raises(ValueError, match=match):
        HybridConfig(**fields)


def _moe_config(router: str, **overrides) -> HybridConfig:
    """One 'E' block: 8 experts of width 12 over hidden 16; sigmoid: 2 groups, one kept,
    top-3, relu² experts and a shared expert; softmax: top-2 SwiGLU experts."""
    fields = dict(
        family="nemotron_h",
        vocab_size=32,
        hidden_size=16,
        layer_pattern="E",
        num_experts=8,
        moe_intermediate_size=12,
        moe_router=router,
    )
    if router == "sigmoid":
        fields |= dict(
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            moe_activation="relu2",
            shared_expert_intermediate_size=8,
        )
    else:
        fields |= dict(num_experts_per_tok=2, moe_activation="silu")
    return HybridConfig(**(fields | overrides))


def _moe_oracle(moe, x: np.ndarray) -> np.ndarray:
    """float64, token by token, no sorting: route, run the chosen experts, sum."""
    cfg = moe.cfg
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(moe.router.kernel[...], np.float64)
    up, down = (np.asarray(p[...], np.float64) for p in (moe.experts_up, moe.experts_down))
    E, k, size = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_experts // cfg.n_group
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if cfg.moe_router == "softmax":
            probs = np.exp(logits[t] - logits[t].max())
            probs /= probs.sum()
            chosen = np.argsort(-logits[t])[:k]
            weights = probs[chosen] / (probs[chosen].sum() if cfg.norm_topk_prob else 1.0)
        else:
            scores = 1.0 / (1.0 + np.exp(-logits[t]))
            choice = scores + np.asarray(moe.score_correction_bias[...], np.float64)
            groups = [
                np.sort(choice[g * size : (g + 1) * size])[-2:].sum() for g in range(E // size)
            ]
            kept = np.argsort(groups)[::-1][: cfg.topk_group]
            allowed = [e for e in range(E) if e // size in kept]
            chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
            weights = scores[chosen] / (scores[chosen].sum() if cfg.norm_topk_prob else 1.0)
        for e, w in zip(chosen, weights * cfg.routed_scaling_factor, strict=True):
            h = x[t] @ up[e]
            if cfg.moe_activation == "silu":
                gate, lin = np.split(h, 2)
                h = gate / (1.0 + np.exp(-gate)) * lin
            else:
                h = np.maximum(h, 0.0) ** 2
            out[t] += w * (h @ down[e])
    if moe.shared_expert is not None:
        shared = moe.shared_expert
        h = np.maximum(x @ np.asarray(shared.up.kernel[...], np.float64), 0.0) ** 2
        out += h @ np.asarray(shared.down.kernel[...], np.float64)
    return out


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize(
    ("router", "overrides"),
    [("sigmoid", {}), ("softmax", {}), ("softmax", dict(norm_topk_prob=False))],
)
def test_moe_layer_matches_a_token_by_token_oracle(router, overrides, implementation):
    cfg = _moe_config(router, **overrides)
    moe = MoE(cfg, dtype=jnp.float32, implementation=implementation, rngs=nnx.Rngs(3))
    if moe.score_correction_bias is not None:
        moe.score_correction_bias[...] = jax.random.uniform(jax.random.key(4), (8,)) * 0.4 - 0.2
    x = jax.random.normal(jax.random.key(5), (13, cfg.hidden_size))
    assert_close(moe(x), _moe_oracle(moe, x), rtol=1e-5, name=f"{router} MoE")


def test_missing_expert_is_reported(tmp_path):
    directory = _copy_fixture("nemotronh_moe", tmp_path)

    def change(t):
        del t["backbone.layers.1.mixer.experts.3.up_proj.weight"]

    _rewrite(directory, change)
    with pytest.raises(ValueError, match=r"layers\.1\.mixer\.experts\.up_proj: experts \[3\]"):
        load_hf_checkpoint(directory)


def test_moe_model_is_differentiable():
    """jax.grad reaches the experts (grouped_matmul) and the router (through the weights)."""
    model = HybridLM(_moe_config("sigmoid"), implementation="auto", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(6), (2, 7), 0, 32)
    grads = nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(model)
    moe = grads.layers[0].mixer
    for g in (moe.experts_up, moe.experts_down, moe.router.kernel):
        g = np.asarray(g[...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_falcon_h1_both_states_carry_across_steps():
    """A parallel layer carries two states (conv/SSM and KV) in one slot: prefill 11 tokens
    (a chunk boundary inside), continue with 8 more from the cache, then decode two: every
    step's logits are the one-pass logits of the same positions."""
    model = load_hf_checkpoint(FIXTURES / "falcon_h1", implementation="xla")
    ids, _ = golden("falcon_h1")
    tokens = ids[0]
    full = np.asarray(jax.jit(model.__call__)(ids[:1]))[0]
    caches = init_cache(model.cfg, num_slots=2, max_len=32)
    slot = 1  # slot 0 stays unused: its state must not leak in

    @functools.partial(jax.jit, static_argnames=("start", "stop", "decode"))
    def step(caches, *, start, stop, decode):
        batch = make_forward_batch(
            jnp.asarray([0, stop - start], jnp.int32),
            jnp.asarray([start], jnp.int32),
            jnp.asarray([slot], jnp.int32),
            num_tokens=stop - start,
            chunk_size=model.cfg.mamba_chunk_size,
            num_decode=int(decode),
        )
        return model.forward(tokens[start:stop], batch, caches)

    for start, stop in ((0, 11), (11, 19), (19, 20), (20, 21)):
        logits, caches = step(caches, start=start, stop=stop, decode=stop - start == 1)
        assert_close(logits, full[start:stop], rtol=1e-5, name=f"tokens {start}:{stop}")


def test_gated_mlp_is_swiglu_over_the_halves_of_gate_up():
    """One stored gate_up weight: ``down(silu(x W_gate · g) · x W_up) · d`` with W_gate and
    W_up its two halves (Falcon-H1's µP multipliers g and d), against float64 NumPy."""
    cfg = HybridConfig.tiny(
        hidden_size=24, intermediate_size=40, mlp_gate_multiplier=0.75, mlp_down_multiplier=1.5
    )
    mlp = MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (5, 24)), np.float64)
    gate_up = np.asarray(mlp.gate_up.kernel[...], np.float64)
    assert gate_up.shape == (24, 2, 40)
    gate, up = x @ gate_up[:, 0] * 0.75, x @ gate_up[:, 1]
    want = (gate / (1 + np.exp(-gate)) * up) @ np.asarray(mlp.down.kernel[...], np.float64) * 1.5
    assert_close(mlp(jnp.asarray(x, jnp.float32)), want, rtol=1e-5)


@pytest.mark.parametrize("kept", ["gate_proj", "up_proj"])
def test_a_gate_without_its_up_is_reported(tmp_path, kept):
    """The loader stacks each MLP's gate_proj and up_proj into one gate_up: a checkpoint
    with one of them alone is refused, naming it (or the missing gate_up)."""
    directory = _copy_fixture("bamba", tmp_path)
    dropped = {"gate_proj": "up_proj", "up_proj": "gate_proj"}[kept]

    def change(t):
        del t[f"model.layers.1.feed_forward.{dropped}.weight"]

    _rewrite(directory, change)
    with pytest.raises(ValueError, match=r"layers\.1\.(feed_forward\.gate_proj|mlp\.gate_up)"):
        load_hf_checkpoint(directory)
