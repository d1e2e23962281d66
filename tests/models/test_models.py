"""Hugging Face parity: every family's logits against golden logits from transformers.

Fixtures (tests/fixtures/<family>/: config.json, model.safetensors, golden.npz) come from
tools/make_hf_fixtures.py (transformers 5.23.0, torch 2.13.0 CPU); CI needs no torch.
"""

from __future__ import annotations

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
from flax_models.model import HybridLM, layer_implementation
from pallas_kernels.testing import assert_close

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
        (
            dict(HUB_CONFIGS["granite_hub_layer_names"][0], num_local_experts=8),
            "num_local_experts=8",
        ),
        (dict(HUB_CONFIGS["nemotron_hub_pattern"][0], hybrid_override_pattern="M*E"), "MoE"),
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
