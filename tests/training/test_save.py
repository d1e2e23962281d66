"""``save_hf_checkpoint``: every fixture family saves back to its own tensors and config, in
one file or in shards with an index, and what it writes loads back to the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from flax_models import HybridConfig, HybridLM, load_hf_checkpoint, save_hf_checkpoint
from flax_models.save import TOKENIZER_FILES, equivalent_configs, hf_config_dict, parse_size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists())


def tensors(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out |= safetensors.numpy.load_file(file)
    return out


def ids(cfg: HybridConfig) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_checkpoint_saves_back_the_same_checkpoint(family, tmp_path):
    """Saved in shards: the same tensors (names, shapes, dtypes, values) and config.json as
    the fixture's, the tokenizer files copied, an index the loader reads back to the same
    logits; saved again from there in one file: the same tensors once more."""
    source = FIXTURES / family
    model = load_hf_checkpoint(source, implementation="xla")
    save_hf_checkpoint(model, tmp_path / "a", tokenizer_from=source, max_shard_size="20KB")
    assert_same_tensors(tensors(tmp_path / "a"), tensors(source))
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    copied = {name for name in TOKENIZER_FILES if (source / name).exists()}
    assert copied == {name for name in TOKENIZER_FILES if (tmp_path / "a" / name).exists()}
    for name in copied:
        assert (tmp_path / "a" / name).read_bytes() == (source / name).read_bytes()

    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    shards = [safetensors.numpy.load_file(tmp_path / "a" / f) for f in files]
    assert all(sum(t.nbytes for t in s.values()) <= 20_000 or len(s) == 1 for s in shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for s in shards for t in s.values())

    # load(save(load(x))): the same logits, bit for bit; saved again, the same tensors.
    again = load_hf_checkpoint(tmp_path / "a", implementation="xla")
    x = ids(model.cfg)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(model(x)))
    save_hf_checkpoint(again, tmp_path / "b")
    assert not (tmp_path / "b" / "model.safetensors.index.json").exists()
    assert_same_tensors(tensors(tmp_path / "b"), tensors(source))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_written_from_fields_reads_back(family):
    """A config with no stored file (built here) gets one that describes it."""
    cfg = HybridConfig.from_hf(json.loads((FIXTURES / family / "config.json").read_text()))
    written = hf_config_dict(dataclasses.replace(cfg, hf_config=None))
    assert HybridConfig.from_hf(written) == cfg
    assert not equivalent_configs(cfg, dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1))


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_random_model_saves_and_loads(preset, tmp_path):
    cfg = getattr(HybridConfig, preset)()
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(1))
    save_hf_checkpoint(model, tmp_path)
    loaded = load_hf_checkpoint(tmp_path, implementation="xla")
    assert equivalent_configs(loaded.cfg, cfg)
    np.testing.assert_array_equal(np.asarray(loaded(ids(cfg))), np.asarray(model(ids(cfg))))


def test_tied_embeddings_save_no_head(tmp_path):
    cfg = HybridConfig.tiny(tie_word_embeddings=True)
    save_hf_checkpoint(HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0)), tmp_path)
    names = set(tensors(tmp_path))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True


def test_dtype_cast_and_bf16_round_trip(tmp_path):
    model = load_hf_checkpoint(FIXTURES / "bamba", implementation="xla")
    save_hf_checkpoint(model, tmp_path / "bf16", dtype=jnp.bfloat16)
    saved = tensors(tmp_path / "bf16")
    assert {t.dtype for t in saved.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # A bf16 checkpoint loaded in bf16 saves back bf16, the same values (A_log, D and
    # dt_bias are fp32 in the model, exactly the bf16 values).
    bf16 = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.bfloat16, implementation="xla")
    save_hf_checkpoint(bf16, tmp_path / "again", dtype=jnp.bfloat16)
    assert_same_tensors(tensors(tmp_path / "again"), saved)
    # Without dtype each tensor keeps the model's own: bf16, the SSM parameters fp32.
    save_hf_checkpoint(bf16, tmp_path / "kept")
    kept = tensors(tmp_path / "kept")
    assert kept["model.layers.0.mamba.A_log"].dtype == np.float32
    assert kept["model.layers.0.mamba.in_proj.weight"].dtype == ml_dtypes.bfloat16


def test_stale_shards_are_removed(tmp_path):
    model = load_hf_checkpoint(FIXTURES / "mamba2", implementation="xla")
    save_hf_checkpoint(model, tmp_path, max_shard_size=10_000)
    save_hf_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("200MB") == 200 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size(1234) == 1234
    assert parse_size("1000") == 1000
    for bad in ("five", "0", -1, "3XB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_config_the_family_cannot_express_is_refused(tmp_path):
    cfg = HybridConfig.tiny(layer_pattern="M-")  # Bamba has no MLP-only blocks
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_pattern='M-' reads back as 'MM'"):
        save_hf_checkpoint(model, tmp_path)
