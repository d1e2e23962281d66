"""The engine request by request (DESIGN §9 "Online engine"): requests join a running batch
at any step, abort, n completions, log-probabilities, and new weights without recompiling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import Engine, RequestOutput, SamplingParams
from flax_models.checkpoint import load_hf_checkpoint
from tests.serving.test_engine import (
    FIXTURES,
    _jitted_forward,
    greedy_references,
    model,
    random_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


def run_to_end(engine: Engine, added_later=None) -> dict[str, RequestOutput]:
    """Steps until every request finished; ``added_later`` maps a step number to requests
    (id, prompt, params) added before that step. The last output of each request."""
    added_later = dict(added_later or {})
    last: dict[str, RequestOutput] = {}
    turn = 0
    while engine.has_unfinished_requests() or added_later:
        for request in added_later.pop(turn, []):
            engine.add_request(*request)
        for output in engine.step():
            assert output.request_id not in last or not last[output.request_id].finished
            last[output.request_id] = output
        turn += 1
        assert turn < 200, "the engine does not finish"
    return last


def test_requests_that_join_a_running_batch_get_their_greedy_tokens():
    m = model()
    prompts = random_prompts(np.random.default_rng(1), m.cfg.vocab_size, (9, 3, 14, 6))
    engine = Engine(m, max_slots=2, max_len=48, token_budget=8, decode_buckets=(1, 2))
    engine.add_request("a", prompts[0], GREEDY)
    later = {2: [("b", prompts[1], GREEDY)], 3: [("c", prompts[2], GREEDY)]}
    later[5] = [("d", prompts[3], SamplingParams(temperature=0.0, max_tokens=3))]
    # Nothing to generate: finished at the next step, taking no slot (it never ended before).
    later[1] = [("z", prompts[1], SamplingParams(n=2, max_tokens=0))]
    outputs = run_to_end(engine, later)
    assert outputs["z"].finished and [o.token_ids for o in outputs["z"].outputs] == [[], []]
    assert {o.finish_reason for o in outputs["z"].outputs} == {"length"}
    tokens = [outputs[i].outputs[0].token_ids for i in "abcd"]
    assert [len(t) for t in tokens] == [5, 5, 5, 3]
    assert tokens == greedy_references(m, prompts, tokens)
    assert all(
        outputs[i].finished and outputs[i].outputs[0].finish_reason == "length" for i in "abcd"
    )
    assert outputs["b"].prompt_token_ids == prompts[1]
    assert engine.num_free_slots == 2 and not engine.has_unfinished_requests()


def test_outputs_are_cumulative_and_reported_when_they_advance():
    m = model()
    engine = Engine(m, max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))
    engine.add_request("x", [3, 4, 5], GREEDY)
    seen = []
    while engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "x"]
    assert seen == [1, 2, 3, 4, 5]


def test_an_aborted_request_frees_its_slot_and_the_others_go_on():
    m = model()
    prompts = random_prompts(np.random.default_rng(2), m.cfg.vocab_size, (5, 7))
    engine = Engine(m, max_slots=2, max_len=48, token_budget=8, decode_buckets=(1, 2))
    engine.add_request("long", prompts[0], SamplingParams(temperature=0.0, max_tokens=30))
    engine.add_request("kept", prompts[1], GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("long")
    engine.abort_request("unknown")  # ignored
    assert engine.num_free_slots == 1
    outputs = run_to_end(engine)
    assert "long" not in outputs and outputs["kept"].finished
    kept = outputs["kept"].outputs[0].token_ids
    assert kept == greedy_references(m, prompts[1:], [kept])[0]
    assert engine.num_free_slots == 2
    assert engine.blocks.num_free_pages == engine.blocks.num_pages


def test_bad_requests_are_rejected_before_anything_is_queued():
    m = model()
    engine = Engine(m, max_slots=2, max_len=16, token_budget=8, decode_buckets=(2,))
    engine.add_request("a", [1, 2], GREEDY)
    bad = [
        (("a", [1, 2], GREEDY), "already in use"),
        (("", [1, 2], GREEDY), "request_id"),
        (("b", [1] * 14, GREEDY), "max_len"),
        (("b", [m.cfg.vocab_size], GREEDY), "vocab_size"),
        (("b", [], GREEDY), "empty"),
        (("b", [1], SamplingParams(stop=["x"], max_tokens=4)), "tokenizer"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args)
    outputs = run_to_end(engine)
    assert list(outputs) == ["a"] and engine.num_free_slots == 2


def test_logprobs_are_the_log_softmax_of_the_forward_at_each_position():
    m = model()
    prompt = random_prompts(np.random.default_rng(3), m.cfg.vocab_size, (6,))[0]
    engine = Engine(m, max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    engine.add_request("lp", prompt, params)
    (completion,) = run_to_end(engine)["lp"].outputs
    tokens = completion.token_ids
    logits = np.asarray(_jitted_forward(m, jnp.asarray([prompt + tokens])))[0]
    reference = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    assert len(completion.logprobs) == len(tokens)
    for i, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        row = reference[len(prompt) - 1 + i]
        top = np.argsort(-row)[:3]
        assert set(entry) == {token, *map(int, top)}  # greedy: the token is the top one
        for t, value in entry.items():
            np.testing.assert_allclose(value, row[t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        completion.cumulative_logprob,
        sum(e[t] for t, e in zip(tokens, completion.logprobs, strict=True)),
        rtol=1e-6,
    )


def test_n_completions_draw_independently_and_reproducibly():
    m = model()
    engine = Engine(m, max_slots=4, max_len=32, token_budget=8, decode_buckets=(4,))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    engine.add_request("n", [5, 6, 7], params)
    first = run_to_end(engine)["n"]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) > 1  # independent draws
    engine.add_request("again", [5, 6, 7], params)
    assert [tuple(c.token_ids) for c in run_to_end(engine)["again"].outputs] == samples
    engine.add_request("one", [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=6, seed=7))
    assert tuple(run_to_end(engine)["one"].outputs[0].token_ids) == samples[0]


def test_update_weights_serves_new_parameters_without_recompiling():
    trained = load_hf_checkpoint(FIXTURES / "bamba", implementation="xla")
    engine = Engine(trained, max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))
    engine.warmup()
    compiled = engine.compile_count
    prompts = random_prompts(np.random.default_rng(4), trained.cfg.vocab_size, (5, 8))
    before = engine.generate(prompts, 4)
    # A training step's worth of change: every parameter moved.
    state = nnx.state(trained, nnx.Param)
    nnx.update(trained, jax.tree.map(lambda p: p * 1.5, state))
    engine.update_weights(trained)
    after = engine.generate(prompts, 4)
    assert after == greedy_references(trained, prompts, after) and after != before
    assert engine.compile_count == compiled
    other = load_hf_checkpoint(FIXTURES / "nemotronh", implementation="xla")
    with pytest.raises(ValueError, match="model"):
        engine.update_weights(other)


def test_under_load_a_prompt_beside_decode_rows_is_cut_to_the_bucket_it_fills():
    # b's 17 prompt tokens beside a's decode row would pad to 32. With c waiting for a slot
    # (the engine is saturated), 16 fill the 16-token bucket and the 17th rides the next
    # step (which the decode row holds anyway) in the 8-token one: 24 tokens computed, not
    # 32. With nothing waiting, b's first token comes first: one step in the padded bucket.
    m = model()
    prompts = random_prompts(np.random.default_rng(6), m.cfg.vocab_size, (4, 17, 4))
    options = dict(max_slots=2, max_len=48, token_budget=32, decode_buckets=(2,))
    buckets = {}
    for load in ("waiting", "idle"):
        engine = Engine(m, token_buckets=(8, 16, 32), **options)
        engine.add_request("a", prompts[0], GREEDY)
        joining = [("b", prompts[1], GREEDY)]
        if load == "waiting":
            joining.append(("c", prompts[2], GREEDY))
        outputs = run_to_end(engine, {1: joining})
        ids = "abc"[: len(joining) + 1]
        tokens = [outputs[i].outputs[0].token_ids for i in ids]
        assert tokens == greedy_references(m, prompts[: len(ids)], tokens)
        buckets[load] = engine.step_buckets
    assert buckets["waiting"][(2, 16)] == 1 and buckets["waiting"][(2, 32)] == 0
    assert buckets["idle"][(2, 32)] == 1 and buckets["idle"][(2, 16)] == 0
