"""SamplingParams, and the device sampler against a NumPy oracle of top-k/top-p filtering."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models import SamplingParams
from flax_models.serving.sampling import filter_logits, request_keys, sample_tokens


def oracle_distribution(
    logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None
) -> dict[int, float]:
    """float64, token by token: ``{token: probability}`` of the tokens a row may draw.
    Temperature, then the top_k largest (ties at the cutoff kept), then, walking down the
    rest by probability, tokens while the mass before them is below top_p (ties with the
    last one kept)."""
    z = np.asarray(logits, np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i])
    allowed = order
    if top_k is not None:
        cutoff = z[order[min(top_k, len(z)) - 1]]
        allowed = [i for i in order if z[i] >= cutoff]
    weights = {i: math.exp(z[i] - z[allowed[0]]) for i in allowed}
    total = sum(weights.values())
    if top_p is not None and top_p < 1:
        kept, mass = [], 0.0
        for i in allowed:
            if mass >= top_p:
                # Data on a knife edge would make the float32 sampler's choice arbitrary.
                assert mass - top_p > 1e-5, "test logits too close to the top-p cutoff"
                break
            assert top_p - mass > 1e-5 or not kept, "test logits too close to the cutoff"
            kept.append(i)
            mass += weights[i] / total
        allowed = [i for i in allowed if z[i] >= z[kept[-1]]]
    total = sum(weights[i] for i in allowed)
    return {i: weights[i] / total for i in allowed}


# (temperature, top_k, top_p) per row; None: no restriction.
ROWS = [
    (1.0, None, None),
    (1.0, 5, None),
    (0.7, None, 0.9),
    (2.0, 10, 0.5),
    (0.5, 1, 0.3),
    (1.3, 40, 0.999),
    (1.0, None, 1.0),
    (3.0, 64, 0.05),
]


def test_filter_logits_matches_the_numpy_oracle():
    rng = np.random.default_rng(0)
    vocab = 64
    logits = rng.normal(size=(len(ROWS), vocab)).astype(np.float32) * 3
    temperature, top_k, top_p = zip(*ROWS, strict=True)
    filtered = jax.jit(filter_logits)(
        jnp.asarray(logits),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray([k or 0 for k in top_k], jnp.int32),
        jnp.asarray([1.0 if p is None else p for p in top_p], jnp.float32),
    )
    probs = np.asarray(jax.nn.softmax(filtered, axis=-1), np.float64)
    for row, (t, k, p) in enumerate(ROWS):
        expected = oracle_distribution(logits[row], t, k, p)
        kept = set(np.flatnonzero(np.isfinite(np.asarray(filtered[row]))))
        assert kept == set(expected), f"row {row} {ROWS[row]}"
        want = np.zeros(vocab)
        want[list(expected)] = list(expected.values())
        np.testing.assert_allclose(probs[row], want, rtol=1e-5, atol=1e-7, err_msg=str(row))


def test_sampled_frequencies_follow_the_oracle():
    """4000 draws of one row, each with its own key: only allowed tokens, at the oracle's
    rates."""
    logits = np.asarray([2.0, 1.5, 1.2, 1.0, 0.4, 0.0, -1.0, -3.0], np.float32)
    draws = 4000
    temperature, top_k, top_p = 0.8, 6, 0.85
    expected = oracle_distribution(logits, temperature, top_k, top_p)
    keys = request_keys(jnp.full(draws, 7, jnp.uint32), jnp.arange(draws, dtype=jnp.int32))
    tokens = np.asarray(
        jax.jit(sample_tokens)(
            jnp.tile(jnp.asarray(logits), (draws, 1)),
            keys,
            jnp.full(draws, temperature),
            jnp.full(draws, top_k, jnp.int32),
            jnp.full(draws, top_p),
        )
    )
    counts = np.bincount(tokens, minlength=len(logits)) / draws
    assert set(np.flatnonzero(counts)) == set(expected)
    for token, probability in expected.items():
        assert abs(counts[token] - probability) < 0.03, (token, counts[token], probability)


def test_a_rows_draw_depends_on_its_key_and_logits_only():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    keys = request_keys(jnp.arange(6, dtype=jnp.uint32) * 11, jnp.arange(6, dtype=jnp.int32))
    sample = jax.jit(lambda logits, keys: sample_tokens(logits, keys, 1.0, 20, 0.9))
    together = np.asarray(sample(logits, keys))
    alone = [int(sample(logits[r : r + 1], keys[r : r + 1])[0]) for r in range(6)]
    assert together.tolist() == alone
    reversed_rows = np.asarray(sample(logits[::-1], keys[::-1]))
    assert reversed_rows[::-1].tolist() == alone


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("temperature", -0.5),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_k", 2.5),
        ("top_k", -2),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_p", float("nan")),
        ("seed", -1),
        ("seed", 2**32),
        ("seed", 1.5),
        ("max_tokens", -1),
        ("max_tokens", 2.0),
        ("n", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", 1),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.5]),
    ],
)
def test_invalid_sampling_params_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_are_canonical():
    params = SamplingParams(temperature=1, top_p=1, stop="END", stop_token_ids=7, seed=2**32 - 1)
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.stop == ("END",) and params.stop_token_ids == (7,)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)
    # vLLM's defaults and order: n, temperature, top_p, top_k, seed, stop, stop_token_ids,
    # max_tokens, logprobs, ignore_eos; top_k 0 and None mean off, as -1.
    assert SamplingParams() == SamplingParams(1, 1.0, 1.0, -1, None, (), (), 16, None, False)
    assert SamplingParams(top_k=0) == SamplingParams(top_k=None) == SamplingParams()
    assert SamplingParams(max_new_tokens=5) == SamplingParams(max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=5, max_new_tokens=5)
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))


def test_sample_tokens_checks_scalar_settings():
    logits = jnp.zeros((2, 8))
    for settings in (dict(top_k=0), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=2.0)):
        with pytest.raises(ValueError, match="top_"):
            sample_tokens(logits, jax.random.key(0), 1.0, **settings)


def test_unset_sampling_fields_take_the_generation_defaults():
    """Only the fields a caller left unset take generation_config.json's values."""
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    params = SamplingParams(temperature=0.0, seed=3).with_defaults(defaults)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.0, 0.9, 7, 3)
    assert SamplingParams().with_defaults(defaults).temperature == 0.6
    assert SamplingParams(top_p=1.0).with_defaults(defaults).top_p == 1.0
