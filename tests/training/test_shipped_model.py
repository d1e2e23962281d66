"""The shipped demo model (``flax_models/assets/kjv-bamba``, ``tools/train_demo_model.py``)
is a trained language model: it predicts English scripture far better than the same
tokens shuffled, which a random or broken checkpoint would not; and it stays small."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import load_hf_checkpoint
from flax_models.demo import DEMO_MODEL

tokenizers = pytest.importorskip("tokenizers")

PASSAGE = (
    "In the beginning God created the heaven and the earth. And the earth was without "
    "form, and void; and darkness was upon the face of the deep. And the Spirit of God "
    "moved upon the face of the waters. And God said, Let there be light: and there was light."
)


def _mean_loss(model, ids: np.ndarray) -> float:
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids[None, :-1]))
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    return float(-jnp.take_along_axis(logp, jnp.asarray(ids[1:, None]), axis=-1).mean())


def test_the_shipped_model_predicts_scripture_not_shuffled_tokens():
    assert sum(f.stat().st_size for f in DEMO_MODEL.iterdir()) <= 10 * 2**20
    tokenizer = tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    ids = np.asarray(tokenizer.encode(PASSAGE).ids, np.int32)
    model = load_hf_checkpoint(DEMO_MODEL, dtype=jnp.float32, implementation="xla")
    text_loss = _mean_loss(model, ids)
    shuffled = np.random.default_rng(0).permutation(ids)
    shuffled_loss = _mean_loss(model, shuffled)
    # A uniform guess over the 4096 tokens costs ln 4096 = 8.3 nats a token.
    assert text_loss < 4.5, text_loss  # 3.7 (the held-out chapters: 3.9)
    assert shuffled_loss > text_loss + 2.0, (text_loss, shuffled_loss)


@pytest.mark.gpu
def test_gpu_the_shipped_shape_trains_in_fp32_through_the_kernels():
    """The shipped model's fp32 train step under ``auto`` (Pallas kernels) equals the xla
    path's loss and gradients; on an H200 it once asked for more shared memory than the
    GPU has (2026-12-02)."""
    from flax_models.training import loss_fn

    ids = jax.random.randint(jax.random.key(0), (4, 512), 0, 4096, jnp.int32)
    results = {}
    for implementation in ("auto", "xla"):
        model = load_hf_checkpoint(DEMO_MODEL, dtype=jnp.float32, implementation=implementation)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, ids)
        results[implementation] = (float(loss), jax.tree.leaves(grads))
    (loss, grads), (ref_loss, ref_grads) = results["auto"], results["xla"]
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    for g, ref in zip(grads, ref_grads, strict=True):
        err = float(jnp.linalg.norm(g - ref) / (jnp.linalg.norm(ref) + 1e-30))
        assert err < 1e-3, err
