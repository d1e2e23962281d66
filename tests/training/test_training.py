"""Training: the padded next-token loss, gradients through the kernels, remat, optax steps.

A tiny hybrid (a Mamba2 block and an attention block, each with its MLP; chunks of 4 so a
sequence spans several) on a right-padded batch whose rows end in different chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
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
    fp32_state,
    loss_fn,
    make_optimizer,
    next_token_cross_entropy,
    packed_loss_fn,
    pad_sequences,
    train_step,
)
from pallas_kernels.backend import on_gpu
from pallas_kernels.testing import assert_close, relative_error

CFG = HybridConfig.tiny(layer_pattern="M*", mamba_chunk_size=4)
LENGTHS = (11, 6, 1)  # ends mid-chunk, on a chunk boundary's neighbour, a lone token
PAD_TO = 12
# On a GPU "auto" runs the Pallas kernels; on a CPU it is the xla path itself, so the
# Pallas kernels are asked for by name there (Triton, in interpret mode).
KERNELS = "auto" if on_gpu() else "triton"


def sequences(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, CFG.vocab_size, n)) for n in LENGTHS]


def model(implementation: str = "xla", remat=None) -> HybridLM:
    """The same weights (same draws) whatever the implementation and remat."""
    return HybridLM(CFG, implementation=implementation, remat=remat, rngs=nnx.Rngs(0))


@nnx.jit
def loss_and_grads(model: HybridLM, input_ids: jax.Array, labels: jax.Array):
    return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(
        model, input_ids, labels
    )


@functools.partial(nnx.jit, static_argnames="max_len")
def packed_loss_and_grads(model: HybridLM, tokens, query_start_loc, *, max_len: int):
    def loss(model, tokens, query_start_loc):
        return packed_loss_fn(model, tokens, query_start_loc, max_len=max_len)

    return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Param))(
        model, tokens, query_start_loc
    )


@nnx.jit
def forward(model: HybridLM, input_ids: jax.Array) -> jax.Array:
    return model(input_ids)


def remat_policies(model: HybridLM, input_ids, labels) -> list:
    """The ``policy`` of every rematerialised region (``jax.checkpoint``'s primitive) in
    the gradient's program."""
    graphdef, state = nnx.split(model)

    def grads(state):
        return jax.grad(lambda m: loss_fn(m, input_ids, labels))(nnx.merge(graphdef, state))

    policies = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "remat2":
                policies.append(eqn.params["policy"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(grads)(state).jaxpr)
    return policies


def flat(grads: nnx.State) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, path)): np.asarray(leaf[...], np.float64)
        for path, leaf in nnx.to_flat_state(grads)
    }


def assert_grads_close(actual: nnx.State, expected: nnx.State, *, rtol: float) -> None:
    """Every parameter's gradient within ``rtol`` (relative Frobenius error) of the other."""
    actual, expected = flat(actual), flat(expected)
    assert actual.keys() == expected.keys()
    errors = {path: relative_error(actual[path], expected[path]) for path in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{worst}: gradient error {errors[worst]:.2e} > {rtol}"
    for path, grad in expected.items():  # no parameter silently gets no gradient
        assert np.any(grad != 0), f"{path}: zero gradient"


def cross_entropy_oracle(logits: np.ndarray, labels: np.ndarray) -> float:
    """float64, one scored target at a time: -log softmax(logits[b, t])[labels[b, t + 1]]."""
    logits = np.asarray(logits, np.float64)
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            row = logits[b, t]
            total += np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[target]
            count += 1
    return total / count


@pytest.fixture(scope="module")
def reference():
    """The xla path's loss and gradients on the padded batch (no remat)."""
    input_ids, labels = pad_sequences(sequences(), length=PAD_TO)
    return (input_ids, labels, *loss_and_grads(model(), input_ids, labels))


def test_pad_sequences():
    input_ids, labels = pad_sequences([[5, 6, 7, 8], [9, 3]], pad_id=1)
    np.testing.assert_array_equal(input_ids, [[5, 6, 7, 8], [9, 3, 1, 1]])
    np.testing.assert_array_equal(labels, [[5, 6, 7, 8], [9, 3, -100, -100]])
    assert input_ids.dtype == labels.dtype == np.int32
    assert pad_sequences([[1]], length=3)[0].shape == (1, 3)
    with pytest.raises(ValueError, match="length=2"):
        pad_sequences([[1, 2, 3]], length=2)
    with pytest.raises(ValueError, match="non-empty"):
        pad_sequences([[1], []])


def test_cross_entropy_matches_float64_oracle():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 7, 11)).astype(np.float32) * 4
    labels = rng.integers(0, 11, (3, 7)).astype(np.int32)
    labels[0, 4:] = IGNORE_INDEX
    labels[2, 1:] = IGNORE_INDEX  # a row with nothing to score
    logits[0, 3:] = np.nan  # positions whose targets are ignored: never read
    loss = next_token_cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    assert loss.dtype == jnp.float32
    assert_close(loss, cross_entropy_oracle(logits, labels), rtol=1e-6, name="loss")
    grad = jax.grad(next_token_cross_entropy)(jnp.asarray(logits), jnp.asarray(labels))
    assert np.all(np.asarray(grad)[0, 3:] == 0) and np.all(np.isfinite(np.asarray(grad)[1]))
    nothing = jnp.full((3, 7), IGNORE_INDEX, jnp.int32)
    zero = jax.value_and_grad(next_token_cross_entropy)(jnp.asarray(logits[1:2]), nothing[:1])
    assert float(zero[0]) == 0.0 and not np.any(np.asarray(zero[1]))
    with pytest.raises(ValueError, match="labels"):
        next_token_cross_entropy(jnp.asarray(logits), jnp.asarray(labels[:, :-1]))


def test_loss_ignores_padding(reference):
    input_ids, labels, loss, grads = reference
    # The mean over the batch's real next tokens (float64, from the model's logits).
    logits = forward(model(), input_ids)
    assert_close(loss, cross_entropy_oracle(logits, labels), rtol=1e-5, name="loss")
    # Other padding tokens: the same loss and gradients, to rounding (the real tokens'
    # logits depend on no padding token).
    other_ids = input_ids.copy()
    padding = labels == IGNORE_INDEX
    other_ids[padding] = np.random.default_rng(2).integers(0, CFG.vocab_size, padding.sum())
    other_loss, other_grads = loss_and_grads(model(), other_ids, labels)
    assert_close(other_loss, loss, rtol=1e-6, name="loss, other padding")
    assert_grads_close(other_grads, grads, rtol=1e-5)


def test_packed_loss_equals_padded(reference):
    """The same sequences packed back to back (an empty one among them, random bucket
    padding after them): the padded batch's loss and gradients."""
    _, _, loss, grads = reference
    seqs = sequences()
    packed = [*seqs[:1], [], *seqs[1:]]
    qsl = np.concatenate([[0], np.cumsum([len(s) for s in packed])]).astype(np.int32)
    padding = np.random.default_rng(3).integers(0, CFG.vocab_size, 5)
    tokens = np.concatenate([*map(np.asarray, seqs), padding]).astype(np.int32)
    packed_loss, packed_grads = packed_loss_and_grads(model(), tokens, qsl, max_len=PAD_TO)
    assert_close(packed_loss, loss, rtol=1e-5, name="packed loss")
    assert_grads_close(packed_grads, grads, rtol=1e-5)
    with pytest.raises(ValueError, match="max_len=8"):
        packed_loss_fn(model(), tokens, qsl, max_len=8)
    with pytest.raises(ValueError, match="query_start_loc"):
        packed_loss_fn(model(), tokens, qsl[::-1])


def test_grad_through_kernels_matches_xla(reference):
    """The issue's acceptance test: ``jax.grad`` through the Pallas kernels' backward
    passes equals the xla path's gradient (fp32, every parameter)."""
    input_ids, labels, loss, grads = reference
    kernel_loss, kernel_grads = loss_and_grads(model(KERNELS), input_ids, labels)
    assert_close(kernel_loss, loss, rtol=1e-5, name=f"{KERNELS} loss")
    assert_grads_close(kernel_grads, grads, rtol=1e-4)


def test_remat_gives_the_same_gradients(reference):
    input_ids, labels, loss, grads = reference
    rematted = model(remat="block")
    assert remat_policies(rematted, input_ids, labels) == [None] * CFG.num_layers
    remat_loss, remat_grads = loss_and_grads(rematted, input_ids, labels)
    assert_close(remat_loss, loss, rtol=1e-6, name="loss")
    assert_grads_close(remat_grads, grads, rtol=1e-5)


def test_remat_policy_reaches_every_block(reference):
    input_ids, labels = reference[:2]
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert remat_policies(model(remat=policy), input_ids, labels) == [policy] * CFG.num_layers
    assert remat_policies(model(), input_ids, labels) == []


def test_remat_argument_is_checked():
    with pytest.raises(ValueError, match="remat='everything'"):
        HybridLM(CFG, remat="everything", rngs=nnx.Rngs(0))


def test_train_steps_reduce_the_loss(reference):
    """AdamW steps on the packed batch (``train_step`` with the packed loss; the padded
    batch's ``loss_fn`` is its default, run by notebooks/04_finetune.ipynb)."""
    first_loss = reference[2]
    seqs = sequences()
    tokens = np.concatenate(seqs).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    loss = functools.partial(packed_loss_fn, max_len=PAD_TO)  # one object: one compilation
    trained = model()
    optimizer = make_optimizer(trained, default_optimizer(1e-2))
    dtypes = {path: leaf[...].dtype for path, leaf in nnx.to_flat_state(nnx.state(trained))}
    # Each step returns the loss before its update.
    losses = [float(train_step(trained, optimizer, tokens, qsl, loss=loss)) for _ in range(5)]
    assert losses[0] == pytest.approx(float(first_loss), rel=1e-5)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.5 * losses[0], losses
    # The parameters keep their dtypes (A_log, D and dt_bias stay fp32 in any model).
    assert {path: leaf[...].dtype for path, leaf in nnx.to_flat_state(nnx.state(trained))} == dtypes


def test_optimizer_state_is_fp32_for_bf16_parameters():
    def bf16_model_and_optimizer():
        bf16 = HybridLM(CFG, dtype=jnp.bfloat16, implementation="xla", rngs=nnx.Rngs(0))
        return bf16, make_optimizer(bf16)

    abstract, optimizer = nnx.eval_shape(bf16_model_and_optimizer)  # shapes and dtypes only
    params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert {a.dtype for a in params} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    state = jax.tree.leaves(nnx.state(optimizer.opt_state))
    floats = [a for a in state if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and all(a.dtype == jnp.float32 for a in floats)
    # fp32_state itself: fp32 moments, updates in the gradients' dtypes, computed in fp32
    # (a bf16 Adam step would round 1 + 1e-3 · 3 to 1 + 2^-8).
    tx = fp32_state(optax.adam(1.0))
    grads = {"w": jnp.asarray([1e-3, -2.0], jnp.bfloat16), "b": jnp.asarray([3.0], jnp.float32)}
    moments = tx.init(grads)
    assert {a.dtype for a in jax.tree.leaves(moments) if a.ndim} == {jnp.dtype(jnp.float32)}
    updates, _ = tx.update(grads, moments, grads)
    assert updates["w"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), [-1, 1], rtol=1e-2)
