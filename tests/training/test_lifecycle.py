"""The training lifecycle around ``train_step``: orbax checkpoints a run resumes from bit
for bit, learning-rate schedules, gradient accumulation, packed batches of several
documents per row that keep them apart, and evaluation."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_models.config import HybridConfig
from flax_models.model import HybridLM
from flax_models.training import (
    IGNORE_INDEX,
    default_optimizer,
    evaluate,
    loss_fn,
    make_optimizer,
    pack_documents,
    packed_loss,
    packed_loss_fn,
    pad_sequences,
    restore_checkpoint,
    save_checkpoint,
    train_step,
    warmup_cosine,
)

CFG = HybridConfig.tiny(
    layer_pattern="M*", vocab_size=64, hidden_size=32, mamba_num_heads=4, mamba_chunk_size=4,
    intermediate_size=48,
)  # fmt: skip
L = 8


def model(seed: int = 0) -> HybridLM:
    return HybridLM(CFG, implementation="xla", rngs=nnx.Rngs(seed))


def batch(seed: int, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (rows, L)).astype(np.int32)


def flat(state) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(state))
    }


def test_restored_run_continues_bit_for_bit(tmp_path):
    tx = default_optimizer(1e-2, warmup_steps=1, total_steps=5)
    run, opt = model(0), None
    opt = make_optimizer(run, tx)
    for seed in (1, 2):
        train_step(run, opt, batch(seed))
    save_checkpoint(tmp_path, run, opt, step=2)
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(tmp_path, run, opt, step=2)
    expected_loss = train_step(run, opt, batch(3))

    resumed = model(1)  # other weights, a fresh optimizer: all of it comes from the file
    resumed_opt = make_optimizer(resumed, tx)
    assert restore_checkpoint(tmp_path, resumed, resumed_opt) == 2
    assert int(resumed_opt.step[...]) == 2
    loss = train_step(resumed, resumed_opt, batch(3))
    assert float(loss) == float(expected_loss)
    for name, want in (flat(run) | flat(opt)).items():
        got = (flat(resumed) | flat(resumed_opt))[name]
        np.testing.assert_array_equal(got, want, err_msg=name)
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(tmp_path / "none", resumed, resumed_opt)


def test_warmup_cosine_schedule():
    schedule = warmup_cosine(1e-3, warmup_steps=10, total_steps=110, end_fraction=0.1)
    assert float(schedule(0)) == 0.0
    assert math.isclose(float(schedule(5)), 5e-4, rel_tol=1e-6)
    assert math.isclose(float(schedule(10)), 1e-3, rel_tol=1e-6)
    assert math.isclose(float(schedule(60)), 1e-4 + 0.5 * 9e-4, rel_tol=1e-5)  # half-way
    assert math.isclose(float(schedule(110)), 1e-4, rel_tol=1e-6)
    assert math.isclose(float(schedule(500)), 1e-4, rel_tol=1e-6)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine(1e-3, warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        default_optimizer(1e-3, warmup_steps=10)


def test_two_accumulated_micro_batches_equal_one_step_on_both():
    big = batch(4, rows=4)
    tx = optax.sgd(0.5)
    accumulated = model()
    opt = make_optimizer(accumulated, tx, accumulate=2)
    before = flat(accumulated)
    train_step(accumulated, opt, big[:2])
    for name, value in flat(accumulated).items():  # the first micro-batch changes nothing
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    train_step(accumulated, opt, big[2:])
    whole = model()
    train_step(whole, make_optimizer(whole, tx), big)
    expected, moved = flat(whole), 0
    for name, got in flat(accumulated).items():
        np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
        moved += not np.array_equal(expected[name], before[name])
    assert moved > 10  # the step did change the parameters
    with pytest.raises(ValueError, match="accumulate"):
        make_optimizer(accumulated, tx, accumulate=0)


def test_pack_documents_layout():
    docs = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6], [4], []]
    first, second = pack_documents(docs, rows=2, length=4)
    np.testing.assert_array_equal(first.tokens, [5, 6, 7, 0, 8, 9, 0, 0])
    np.testing.assert_array_equal(first.labels, [5, 6, 7, IGNORE_INDEX, 8, 9] + [IGNORE_INDEX] * 2)
    np.testing.assert_array_equal(first.query_start_loc, [0, 3, 4, 6])
    np.testing.assert_array_equal(second.tokens, [1, 2, 3, 4, 5, 6, 4, 0])
    np.testing.assert_array_equal(second.query_start_loc, [0, 4, 6, 7])
    (padded,) = pack_documents(docs[:2], rows=2, length=4, max_documents=4)
    np.testing.assert_array_equal(padded.query_start_loc, [0, 3, 4, 6, 6])  # zero-length tail
    with pytest.raises(ValueError, match="max_documents"):
        pack_documents(docs, rows=2, length=4, max_documents=2)


@functools.partial(nnx.jit, static_argnames="max_len")
def packed_grads(model, tokens, qsl, labels, *, max_len):
    loss = functools.partial(packed_loss_fn, max_len=max_len)
    return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Param))(model, tokens, qsl, labels)


@nnx.jit
def padded_grads(model, input_ids, labels):
    return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(
        model, input_ids, labels
    )


def test_packed_documents_do_not_see_their_neighbours():
    """A document's loss and gradients in a packed row are those it has alone, whatever
    the documents beside it (different neighbours: the same numbers)."""
    rng = np.random.default_rng(5)
    doc = list(rng.integers(0, CFG.vocab_size, 6))  # crosses a chunk boundary (chunk 4)
    m = model()

    def alone_in_pack(neighbours):
        (packed,) = pack_documents([neighbours[0], doc, neighbours[1]], rows=2, length=L)
        start = int(packed.query_start_loc[1])
        labels = np.full_like(packed.labels, IGNORE_INDEX)  # score the document only
        labels[start : start + len(doc)] = doc
        assert list(packed.tokens[start : start + len(doc)]) == doc
        return packed_grads(m, packed.tokens, packed.query_start_loc, labels, max_len=L)

    loss_a, grads_a = alone_in_pack([[1, 2], [3, 4, 5, 6, 7]])
    loss_b, grads_b = alone_in_pack([[9, 9], [8, 7, 6, 5, 4, 3, 2]])
    input_ids, labels = pad_sequences([doc])
    loss, grads = padded_grads(m, input_ids, labels)
    assert abs(float(loss_a) - float(loss)) <= 1e-6 * abs(float(loss))
    assert float(loss_a) == float(loss_b)
    want, a, b = flat(grads), flat(grads_a), flat(grads_b)
    for name, value in want.items():
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        scale = np.abs(value).max() + 1e-12
        assert np.abs(a[name] - value).max() <= 1e-5 * scale, name


def test_evaluate_weighs_batches_by_their_targets():
    m = model()
    first, labels = pad_sequences([list(range(1, 9)), [3, 4, 5]], length=L)
    second = batch(6)
    result = evaluate(m, [(first, labels), (second,)])
    together = loss_fn(m, jnp.concatenate([first, second]), jnp.concatenate([labels, second]))
    assert result["tokens"] == 7 + 2 + 2 * (L - 1)
    assert math.isclose(result["loss"], float(together), rel_tol=1e-6)
    assert math.isclose(result["perplexity"], math.exp(result["loss"]), rel_tol=1e-12)
    packed = pack_documents([list(range(1, 9)), [3, 4, 5], *second.tolist()], rows=4, length=L)
    on_packed = evaluate(m, packed, loss=packed_loss(L))
    assert on_packed["tokens"] == result["tokens"]
    assert math.isclose(on_packed["loss"], result["loss"], rel_tol=1e-5)
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.all(a == b)), nnx.state(m), nnx.state(model()))
    )
