"""Serving path: generation, continuous batching, chunked prefill, slots, compile counts."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models.batching import Request
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.engine import Engine
from pallas_kernels.testing import assert_close

FIXTURES = Path(__file__).parent.parent / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").exists())
_MODELS = {}


def model(family: str = "bamba"):
    if family not in _MODELS:
        _MODELS[family] = load_hf_checkpoint(FIXTURES / family, implementation="xla")
    return _MODELS[family]


def random_prompts(rng, vocab: int, lengths) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def greedy_reference(m, prompt: list[int], generated: list[int]) -> list[int]:
    """argmax of the plain forward over prompt + generated, at every generated step."""
    logits = np.asarray(m(jnp.asarray([prompt + generated])))[0]
    return [int(t) for t in np.argmax(logits[len(prompt) - 1 : -1], axis=-1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_the_argmax_of_the_forward(family):
    m = model(family)
    prompts = random_prompts(np.random.default_rng(0), m.cfg.vocab_size, (5, 23, 1, 12))
    engine = Engine(m, max_slots=2, max_len=64, token_budget=16)  # two prompts wait
    for prompt, generated in zip(prompts, engine.generate(prompts, 6), strict=True):
        assert len(generated) == 6
        assert generated == greedy_reference(m, prompt, generated)


def test_same_tokens_alone_and_in_a_batch():
    m = model()
    rng = np.random.default_rng(1)
    target = random_prompts(rng, m.cfg.vocab_size, (19,))[0]
    others = random_prompts(rng, m.cfg.vocab_size, rng.integers(1, 40, size=8))
    alone = Engine(m, max_slots=4, max_len=64, token_budget=16).generate([target], 8)[0]
    batched = Engine(m, max_slots=4, max_len=64, token_budget=16).generate(
        others[:3] + [target] + others[3:], 8
    )
    assert batched[3] == alone


def prefill_logits(engine: Engine, prompt: list[int], budget: int, slot: int = 0):
    """Prefills ``prompt`` in chunks of ``budget`` tokens; returns {position: logits}."""
    out, done = {}, 0
    while done < len(prompt):
        chunk = prompt[done : done + budget]
        arrays = engine.builder.build([], [Request(slot, chunk, done)])
        out[done + len(chunk) - 1] = engine.step(arrays)[0]
        done += len(chunk)
    return out


@pytest.mark.parametrize("family", ["bamba", "nemotronh"])
def test_chunked_prefill_gives_the_logits_of_one_pass(family):
    m = model(family)
    cs = m.cfg.mamba_chunk_size
    prompt = random_prompts(np.random.default_rng(2), m.cfg.vocab_size, (3 * cs + 9,))[0]
    full = np.asarray(m(jnp.asarray([prompt])))[0]
    for budget in (1, 7, cs - 1, 3 * cs + 5):
        engine = Engine(m, max_slots=2, max_len=4 * cs, token_budget=budget)
        for position, logits in prefill_logits(engine, prompt, budget).items():
            assert_close(
                logits, full[position], rtol=1e-4, name=f"budget {budget}, position {position}"
            )


def test_a_reused_slot_carries_nothing_over():
    m = model()
    rng = np.random.default_rng(3)
    first, second = random_prompts(rng, m.cfg.vocab_size, (30, 11))
    fresh = Engine(m, max_slots=1, max_len=64).generate([second], 5)
    engine = Engine(m, max_slots=1, max_len=64)
    engine.generate([first], 7)
    assert engine.generate([second], 5) == fresh


def test_no_compilation_after_warmup():
    m = model()
    engine = Engine(m, max_slots=4, max_len=64, token_budget=16)
    compiled = engine.warmup()
    assert compiled == len(engine.builder.buckets())
    rng = np.random.default_rng(4)
    for _ in range(200):
        slots = rng.permutation(4)
        num_decode = int(rng.integers(0, 5))
        decode = [
            Request(int(s), [int(rng.integers(0, 100))], int(rng.integers(1, 60)))
            for s in slots[:num_decode]
        ]
        prefill, budget = [], 16
        for s in slots[num_decode:]:
            n = int(rng.integers(0, budget + 1))
            if n:
                prefill.append(Request(int(s), [1] * n, int(rng.integers(0, 64 - n))))
                budget -= n
        if decode or prefill:
            engine.step(engine.builder.build(decode, prefill))
    assert engine.compile_count == compiled
    engine.generate(random_prompts(rng, m.cfg.vocab_size, (3, 33, 17, 1, 20)), 4)
    assert engine.compile_count == compiled


@pytest.mark.parametrize(
    ("decode", "prefill", "match"),
    [
        ([], [Request(0, [1] * 65, 0)], "exceed max_len=64"),
        ([], [Request(0, [], 0)], "empty prompt"),
        ([Request(9, [1], 3)], [], "unknown slot"),
        ([Request(1, [1], 3)], [Request(1, [2, 3], 0)], "slot appears twice"),
        ([Request(1, [1, 2], 3)], [], "exactly one token"),
        ([], [Request(0, [1] * 17, 0)], "exceed the largest token bucket"),
    ],
)
def test_builder_rejects_bad_requests_before_touching_caches(decode, prefill, match):
    engine = Engine(model(), max_slots=4, max_len=64, token_budget=16)
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(engine.caches)]
    with pytest.raises(ValueError, match=match):
        engine.builder.build(decode, prefill)
    after = jax.tree.leaves(engine.caches)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, after, strict=True))


def test_generate_rejects_prompts_before_any_step():
    engine = Engine(model(), max_slots=2, max_len=32)
    for prompts, match in (([[1] * 30], "exceed max_len=32"), ([[1], []], "prompt 1 is empty")):
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, 4)
    assert engine.compile_count == 0


def test_bad_top_k_is_rejected_before_any_step():
    engine = Engine(model(), max_slots=2, max_len=32)
    with pytest.raises(ValueError, match="top_k"):
        engine.generate([[1, 2, 3]], 4, temperature=1.0, top_k=0)
    assert engine.compile_count == 0


def test_sampling_is_seeded_and_respects_top_k():
    m = model()
    prompts = random_prompts(np.random.default_rng(5), m.cfg.vocab_size, (7, 4))
    run = lambda seed: Engine(m, max_slots=2, max_len=32).generate(  # noqa: E731
        prompts, 5, temperature=1.0, top_k=3, seed=seed
    )
    assert run(0) == run(0)
    greedy = Engine(m, max_slots=2, max_len=32).generate(prompts, 5)
    top1 = Engine(m, max_slots=2, max_len=32).generate(prompts, 5, temperature=0.7, top_k=1)
    assert top1 == greedy


def test_eos_stops_a_sequence_early():
    m = model()
    prompt = random_prompts(np.random.default_rng(6), m.cfg.vocab_size, (9,))[0]
    greedy = Engine(m, max_slots=1, max_len=32).generate([prompt], 6)[0]
    stopped = Engine(m, max_slots=1, max_len=32).generate([prompt], 6, eos_id=greedy[2])[0]
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]
