"""LoRA: adapters as ``nnx.LoRAParam`` on the projections, trained alone through the
optimizer's filter, merged for serving, saved and loaded in PEFT's format."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

from flax_models import HybridConfig, HybridLM, load_hf_checkpoint
from flax_models.lora import add_lora, load_lora_adapter, merge_lora, save_lora_adapter
from flax_models.training import make_optimizer, train_step

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
IDS = np.random.default_rng(0).integers(0, 96, (2, 12)).astype(np.int32)


def flat(state) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def trained(family: str, **lora) -> HybridLM:
    """A fixture with adapters, after one step that moved them (B no longer zero)."""
    model = add_lora(load_hf_checkpoint(FIXTURES / family, implementation="xla"), **lora)
    train_step(model, make_optimizer(model, optax.adam(1e-2), trainable=nnx.LoRAParam), IDS)
    return model


def test_zero_b_leaves_the_logits_unchanged():
    model = load_hf_checkpoint(FIXTURES / "bamba", implementation="xla")
    before = np.asarray(model(IDS))
    add_lora(model, rank=4, alpha=8)
    np.testing.assert_array_equal(np.asarray(model(IDS)), before)


def test_only_the_adapters_train_and_hold_optimizer_state():
    model = add_lora(load_hf_checkpoint(FIXTURES / "bamba", implementation="xla"), rank=4, alpha=8)
    adapters = flat(nnx.state(model, nnx.LoRAParam))
    # in/out_proj of 2 Mamba layers, q/k/v/o of 1 attention layer, gate_up and down of 3 MLPs
    assert len(adapters) == 2 * (2 * 2 + 4 + 3 * 2)
    before = flat(nnx.state(model))
    optimizer = make_optimizer(model, optax.adam(1e-2), trainable=nnx.LoRAParam)
    moments = [a for a in jax.tree.leaves(nnx.state(optimizer)) if a.ndim > 0]
    assert sorted(a.size for a in moments) == sorted(2 * [a.size for a in adapters.values()])
    train_step(model, optimizer, IDS)
    # The base weights stay; every B moves; A gets no gradient while B is zero (x^T g B^T).
    for name, value in flat(nnx.state(model)).items():
        moved = not np.array_equal(value, before[name])
        assert moved == name.endswith("lora_b"), name


def test_merge_equals_the_adapted_model():
    model = trained("bamba", rank=4, alpha=8)
    adapted = np.asarray(model(IDS))
    assert np.abs(adapted - np.asarray(load_hf_checkpoint(FIXTURES / "bamba")(IDS))).max() > 1e-3
    merge_lora(model)
    assert not nnx.state(model, nnx.LoRAParam)
    plain = load_hf_checkpoint(FIXTURES / "bamba", implementation="xla")
    assert nnx.graphdef(model) == nnx.graphdef(plain)  # a plain HybridLM again
    merged = np.asarray(model(IDS))
    assert np.linalg.norm(merged - adapted) <= 1e-5 * np.linalg.norm(adapted)


@pytest.mark.parametrize(
    ("family", "names"),
    [
        ("bamba", {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                   "gate_proj", "up_proj", "down_proj"}),
        ("granitemoehybrid", {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                              "input_linear", "output_linear"}),
    ],
)  # fmt: skip
def test_peft_adapter_round_trip(family, names, tmp_path):
    model = trained(family, rank=4, alpha=16)
    save_lora_adapter(model, tmp_path, base_model_name_or_path="ibm/base")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert set(config["target_modules"]) == names
    assert config["base_model_name_or_path"] == "ibm/base"
    tensors = safetensors.numpy.load_file(tmp_path / "adapter_model.safetensors")
    root = "base_model.model.model.layers"
    a, b = (
        tensors[f"{root}.0.mamba.in_proj.lora_A.weight"],
        tensors[f"{root}.0.mamba.in_proj.lora_B.weight"],
    )
    in_proj = model.layers[0].mixer.in_proj.kernel.shape  # [in, out]
    assert a.shape == (4, in_proj[0]) and b.shape == (in_proj[1], 4)  # PEFT's [r, in], [out, r]
    np.testing.assert_array_equal(a, np.asarray(model.layers[0].mixer.in_proj.lora_a[...]).T)
    mlp = (
        f"{root}.0.shared_mlp.input_linear"
        if family == "granitemoehybrid"
        else f"{root}.0.feed_forward.gate_proj"
    )
    width = model.layers[0].mlp.gate_up.kernel.shape[-1]
    assert tensors[f"{mlp}.lora_B.weight"].shape == ((2 if "input_linear" in mlp else 1) * width, 4)
    # A fresh base model reads the adapter back to the same logits.
    loaded = load_lora_adapter(
        load_hf_checkpoint(FIXTURES / family, implementation="xla"), tmp_path
    )
    np.testing.assert_array_equal(np.asarray(loaded(IDS)), np.asarray(model(IDS)))
    assert (
        flat(nnx.state(loaded, nnx.LoRAParam)).keys()
        == flat(nnx.state(model, nnx.LoRAParam)).keys()
    )


def test_targets_choose_the_projections():
    model = HybridLM(HybridConfig.tiny(), implementation="xla", rngs=nnx.Rngs(0))
    add_lora(model, rank=2, alpha=2, targets=("q_proj", "v_proj", "mamba"))
    owners = {p.rsplit("/", 2)[-2] for p in flat(nnx.state(model, nnx.LoRAParam))}
    assert owners == {"q_proj", "v_proj", "in_proj", "out_proj"}
    with pytest.raises(ValueError, match="already has"):
        add_lora(model, rank=2, alpha=2, targets="q_proj")
    with pytest.raises(ValueError, match="LoRA target 'lm_head'"):
        add_lora(model, rank=2, alpha=2, targets="lm_head")
    attention_free = HybridLM(HybridConfig.tiny(layer_pattern="MM"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no projection"):
        add_lora(attention_free, rank=2, alpha=2, targets="attention")


def test_models_built_on_a_mesh_are_refused():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    model = nnx.eval_shape(lambda: HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0), mesh=mesh))
    with pytest.raises(NotImplementedError, match="mesh"):
        add_lora(model, rank=2, alpha=2)
