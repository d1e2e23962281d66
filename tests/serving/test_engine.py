"""Serving path: generation, continuous batching, chunked prefill, slots, compile counts."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels as pk
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.serving.batching import Request
from flax_models.serving.engine import Engine
from flax_models.serving.runner import CUBLAS_ONLY_MIN_ROWS, step_xla_options
from flax_models.serving.sampling import SamplingParams, sample_tokens
from flax_models.training import pad_sequences
from pallas_kernels.testing import assert_close
from tests.helpers import primitives_outside_kernels

FIXTURES = Path(__file__).parent.parent / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").exists())
_MODELS = {}


def model(family: str = "bamba"):
    if family not in _MODELS:
        _MODELS[family] = load_hf_checkpoint(FIXTURES / family, implementation="xla")
    return _MODELS[family]


@pytest.fixture(scope="module")
def small_engine() -> Engine:
    """One engine of three programs, shared by the tests that only need some steps."""
    return Engine(model(), max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))


@contextlib.contextmanager
def backend_compiles():
    """Names of the programs XLA compiles while open, from JAX's own monitoring event (one
    per backend compilation, whatever triggered it: a jit, an eager op, a key helper)."""
    names: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        del duration
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def program_count(engine: Engine) -> int:
    """A step program per bucket (its greedy tokens included), and the sampler's two
    (drawing, drawing with top-k/top-p) and the log-probabilities' per count of sequence
    rows."""
    builder = engine.builder
    row_counts = {d + (builder.prefill_seqs if t else 0) for d, t in builder.buckets()}
    return len(builder.buckets()) + 3 * len(row_counts)


def random_prompts(rng, vocab: int, lengths) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def greedy_references(m, prompts: list[list[int]], generations: list[list[int]]):
    """For each prompt, the argmax of the plain forward over prompt + its generated tokens
    at every generated step. One jitted forward of all rows, each padded on the right: a
    causal model's positions do not see the ones after them (eager, a forward per row
    compiled every op for every length)."""
    rows = [p + g for p, g in zip(prompts, generations, strict=True)]
    ids, _ = pad_sequences(rows)
    logits = np.asarray(_jitted_forward(m, jnp.asarray(ids)))
    return [
        [int(t) for t in np.argmax(logits[i, len(p) - 1 : len(r) - 1], axis=-1)]
        for i, (p, r) in enumerate(zip(prompts, rows, strict=True))
    ]


_jitted_forward = nnx.jit(lambda m, ids: m(ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_the_argmax_of_the_forward(family):
    m = model(family)
    prompts = random_prompts(np.random.default_rng(0), m.cfg.vocab_size, (5, 23, 1, 12))
    # Two prompts wait; one bucket of each kind (three step programs: the bucket choice is
    # the scheduler's tests' job, the families' layers are this one's).
    engine = Engine(
        m, max_slots=2, max_len=64, token_budget=16, decode_buckets=(2,), token_buckets=(16,)
    )
    generations = engine.generate(prompts, 6)
    assert [len(g) for g in generations] == [6] * len(prompts)
    assert generations == greedy_references(m, prompts, generations)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_internal_decode_step_on_packed_rows_gives_the_forward_logits(family, monkeypatch):
    """A step of decode rows only runs each Mamba mixer through ``mamba2_decode`` (here on
    its Triton kernels, interpreted off-GPU): with the gated norm (Bamba) and without it
    (Falcon-H1, where z gates the state update), its logits are the plain forward's, and no
    exponential runs outside the kernels (the decay rates' included)."""
    from flax_models.layers import mamba2

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return original(*args, **kwargs)

    original = mamba2.pk.mamba2_decode
    monkeypatch.setattr(mamba2.pk, "mamba2_decode", counted)
    m = load_hf_checkpoint(FIXTURES / family, implementation="triton")
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, m.cfg.vocab_size, (6, 3))
    next_tokens = [int(t) for t in rng.integers(0, m.cfg.vocab_size, size=2)]
    engine = Engine(
        m, max_slots=2, max_len=16, token_budget=16, decode_buckets=(2,), kv_block_size=16
    )
    engine.step(engine.builder.build([], [Request(s, p, 0) for s, p in enumerate(prompts)]))
    assert not calls, "a prefill step ran the decode mixer"
    rows = enumerate(zip(prompts, next_tokens, strict=True))
    decode = [Request(s, [t], len(p)) for s, (p, t) in rows]
    step_args = {}
    jitted = engine.runner.step_program

    def shapes_kept(*args, **kwargs):  # the shapes of the step's arguments (some donated)
        step_args.update(
            args=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args), kw=kwargs
        )
        return jitted(*args, **kwargs)

    engine.runner.step_program = shapes_kept
    logits = np.asarray(engine.step(engine.builder.build(decode, [])))
    assert calls and set(calls) == {"triton"}
    # A = -exp(A_log) is taken inside the state update's kernel: no XLA kernel a layer.
    step = functools.partial(engine.runner.step_function, **step_args["kw"])
    jaxpr = jax.make_jaxpr(step)(*step_args["args"])
    assert "exp" not in primitives_outside_kernels(jaxpr.jaxpr)
    for s, (prompt, token) in enumerate(zip(prompts, next_tokens, strict=True)):
        full = np.asarray(model(family)(jnp.asarray([prompt + [token]])))[0, -1]
        assert_close(logits[s], full, rtol=1e-4, name=f"{family} row {s}")


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
    """After warmup() nothing compiles, whatever the mix of steps, prompt lengths and
    sampling settings; compile_count is the number of programs XLA really compiled."""
    m = model()
    engine = Engine(m, max_slots=4, max_len=64, token_budget=16)
    with backend_compiles() as at_warmup:
        compiled = engine.warmup()
    assert compiled == program_count(engine) == len(at_warmup), at_warmup
    rng = np.random.default_rng(4)
    with backend_compiles() as after_warmup:
        for _ in range(100):
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
        settings = ((0.0, None, None, 0), (1.0, 3, None, 1), (0.7, None, 0.9, 2**32 - 1))
        for temperature, top_k, top_p, seed in settings:
            lengths = rng.integers(1, 40, size=int(rng.integers(1, 7)))
            engine.generate(
                random_prompts(rng, m.cfg.vocab_size, lengths),
                int(rng.integers(1, 5)),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
            )
        # Every request with its own settings, in one generation.
        mixed = [
            SamplingParams(
                max_new_tokens=int(rng.integers(1, 5)),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop_token_ids=(7,),
            )
            for temperature, top_k, top_p, seed in settings * 2
        ]
        lengths = rng.integers(1, 40, size=len(mixed))
        engine.generate(random_prompts(rng, m.cfg.vocab_size, lengths), sampling=mixed)
    assert after_warmup == []
    assert engine.compile_count == compiled


# An engine with prefix caching (its steps take the snapshot arguments too), greedy
# tokens of three prompts; run here and, for the executable cache, in a fresh process.
_CACHED_ENGINE = """
import json, sys
from pathlib import Path
import numpy as np
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.serving.engine import Engine

def run(directory, max_len=64):
    m = load_hf_checkpoint(Path("tests/fixtures/bamba"), implementation="xla")
    engine = Engine(m, max_slots=4, max_len=max_len, token_budget=16, prefix_caching=True,
                    executable_cache_dir=directory)
    engine.warmup(progress=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, m.cfg.vocab_size, size=n)] for n in (5, 17, 30)]
    tokens = engine.generate(prompts, 6)
    return dict(loaded=engine.runner.loaded_count, compiled=engine.compile_count,
                steps=len(engine.builder.buckets()), tokens=tokens)

if __name__ == "__main__":
    print("RESULT " + json.dumps(run(sys.argv[1])))
"""


def test_executable_cache_loads_the_step_programs_in_a_later_process(tmp_path):
    """``executable_cache_dir``: the first engine compiles and writes every step program;
    an engine in a fresh process loads them all (none traced or compiled: only the
    samplers compile) and generates the same tokens; an unreadable entry is compiled
    afresh and written again, and an engine of other cache shapes finds none of them."""
    source = _CACHED_ENGINE.replace("tests/fixtures/bamba", str(FIXTURES / "bamba"))
    script = tmp_path / "cached_engine.py"
    script.write_text(source)
    namespace = {"__name__": "cached_engine"}
    exec(compile(source, str(script), "exec"), namespace)
    directory = tmp_path / "executables"
    first = namespace["run"](directory)
    entries = sorted(directory.iterdir())
    assert first["loaded"] == 0 and len(entries) == first["steps"]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS="cpu")

    def later_process():
        done = subprocess.run(
            [sys.executable, str(script), str(directory)],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line.removeprefix("RESULT ")), done.stderr

    later, _ = later_process()
    assert later["loaded"] == later["steps"] == first["steps"]
    assert later["compiled"] == first["compiled"] - first["steps"]  # the samplers only
    assert later["tokens"] == first["tokens"]

    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated
    again, log = later_process()
    assert again["loaded"] == first["steps"] - 1 and "unreadable" in log
    assert again["tokens"] == first["tokens"]
    assert len(entries[0].read_bytes()) > 100  # written again
    assert namespace["run"](directory, max_len=48)["loaded"] == 0


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
        engine.generate([[1, 2, 3]], 4, temperature=1.0, top_k=-2)  # -1 and 0 are "off"
    assert engine.compile_count == 0


def test_sampling_is_seeded_and_respects_top_k(small_engine):
    m = model()
    prompts = random_prompts(np.random.default_rng(5), m.cfg.vocab_size, (7, 4))
    run = lambda seed: small_engine.generate(  # noqa: E731
        prompts, 5, temperature=1.0, top_k=3, seed=seed
    )
    assert run(0) == run(0)
    assert run(0) != run(1)
    greedy = small_engine.generate(prompts, 5)
    assert small_engine.generate(prompts, 5, temperature=0.7, top_k=1) == greedy


def test_internal_greedy_steps_launch_no_sampler(small_engine, monkeypatch):
    """A greedy step's tokens are the argmax its step program takes: no sampler program
    runs (a launch and, under tp, a rendezvous of the devices per step); a step where some
    row draws runs one, over the same slots' tokens."""
    launched = []
    sampler = small_engine.runner.sampler_program
    monkeypatch.setattr(
        small_engine.runner,
        "sampler_program",
        lambda *a, **k: launched.append(k) or sampler(*a, **k),
    )
    prompts = random_prompts(np.random.default_rng(8), model().cfg.vocab_size, (6, 3))
    greedy = small_engine.generate(prompts, 4)
    assert launched == []
    mixed = [SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4)]
    outputs = small_engine.generate(prompts, sampling=mixed)
    assert launched and all(k["draws"] for k in launched)
    assert outputs[0] == greedy[0]  # the greedy row of a drawing step keeps its argmax


def test_sample_tokens_takes_temperature_and_top_k_per_row_as_data():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    greedy = np.argmax(np.asarray(logits), axis=-1)
    temperature = jnp.asarray([0.0, 1.0, 1.0, 5.0, 0.0, 2.0], jnp.float32)
    top_k = jnp.asarray([0, 3, 1, 3, 3, 0], jnp.int32)  # 0: no restriction
    sample = jax.jit(sample_tokens)
    draws = np.stack(
        [np.asarray(sample(logits, jax.random.key(i), temperature, top_k)) for i in range(40)]
    )
    assert (draws[:, [0, 2, 4]] == greedy[[0, 2, 4]]).all()  # temperature 0 or top-1
    for row in (1, 3):
        assert set(draws[:, row]) <= set(top3[row]) and len(set(draws[:, row])) > 1
    assert len(set(draws[:, 5])) > 3  # the whole vocabulary at temperature 2
    with pytest.raises(ValueError, match="top_k"):
        sample_tokens(logits, jax.random.key(0), 1.0, 0)


def test_eos_stops_a_sequence_early(small_engine):
    m = model()
    prompt = random_prompts(np.random.default_rng(6), m.cfg.vocab_size, (9,))[0]
    greedy = small_engine.generate([prompt], 6)[0]
    stopped = small_engine.generate([prompt], 6, eos_id=greedy[2])[0]
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]


def test_warmup_compiles_the_buckets_asked_for():
    """``warmup(buckets=...)`` compiles those steps (in threads) and their rows' samplers,
    and the compiled executables are the ones the steps then run: nothing compiles again."""
    engine = Engine(model(), max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))
    with pytest.raises(ValueError, match="buckets"):
        engine.warmup(buckets=[(3, 0)])
    with backend_compiles() as compiled:
        count = engine.warmup(buckets=[(2, 0), (0, 16)], compile_workers=2)
    # Two steps, and for their row count (two rows each) two samplers and the logprobs'.
    assert count == 2 + 3, compiled
    assert compiled.count("jit(step_function)") == 2, compiled
    with backend_compiles() as after:
        engine.step(engine.builder.build([Request(0, [5], 3)], []))
        # The samplers (drawing, with a cutoff) and the logprobs' were compiled in the
        # threads too: a sampled request with logprobs compiles nothing.
        params = SamplingParams(max_tokens=2, temperature=0.9, top_p=0.8, seed=1, logprobs=2)
        engine.generate([[5, 6]], sampling=params)
    assert after == []


def test_no_program_decides_on_the_device(monkeypatch):
    """On a GPU the host waits for a lax.cond's predicate, so a step holding one could not
    be launched while the one before it runs: the engine's programs have none (whether
    a step's rows draw or restrict is host data, and picks the sampler program)."""

    def device_cond(*args, **kwargs):
        raise AssertionError("a lax.cond in an engine program")

    monkeypatch.setattr(jax.lax, "cond", device_cond)
    engine = Engine(model(), max_slots=2, max_len=32, token_budget=8, decode_buckets=(2,))
    engine.warmup()


def test_internal_stream_runs_a_step_ahead_and_discards_rows_past_an_end(monkeypatch):
    """The scheduler launches step n + 1 (decode rows fed from the device) before it reads
    step n's tokens; rows of sequences that ended in step n are dropped and their slots
    reused: the tokens are the forward's greedy argmax, cut after the first eos."""
    m = model()
    prompts = random_prompts(np.random.default_rng(11), m.cfg.vocab_size, (7, 3, 12, 5, 9))
    engine = Engine(m, max_slots=2, max_len=64, token_budget=8, decode_buckets=(2,))
    full = engine.generate(prompts, 8)
    assert full == greedy_references(m, prompts, full)
    eos = full[0][2]
    order = []
    real_run, real_land = engine.runner.launch, engine.scheduler.land

    def run(*args, **kwargs):
        order.append("launch")
        return real_run(*args, **kwargs)

    def land(*args, **kwargs):
        order.append("read")
        return real_land(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", run)
    monkeypatch.setattr(engine.scheduler, "land", land)
    stopped = engine.generate(prompts, 8, eos_id=eos)
    for generated, tokens in zip(full, stopped, strict=True):
        assert tokens == (generated[: generated.index(eos) + 1] if eos in generated else generated)
    assert len(stopped[0]) == 3
    # Steps overlap: a read comes after the next step's launch (launch, launch, read).
    assert "launch,launch,read" in ",".join(order)


def test_default_token_buckets_pad_prompts_by_at_most_sqrt2():
    """The engine's default token buckets hold any prompt-token count n of a step in at most
    max(16, ceil16(√2 n)) tokens (powers of two, and multiples of 4096 below 4096, pad up
    to 2n), and stay logarithmic in the budget: at most 2 log2(budget / 16) + 1 programs of
    each decode bucket, whatever the traffic."""
    budget = 3000
    engine = Engine(model(), max_slots=2, max_len=budget, token_budget=budget)
    buckets = engine.builder.token_buckets
    counts = np.arange(1, budget + 1)
    held = np.array([pk.bucket_for(int(n), buckets) for n in counts])
    bound = np.maximum(16, -(-np.ceil(np.sqrt(2) * counts).astype(int) // 16) * 16)
    assert np.all(held <= bound), counts[held > bound][:5]
    assert max(buckets) >= budget
    assert len(buckets) <= 2 * np.log2(budget / 16) + 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(max_slots=0), "max_slots"),
        (dict(max_len=0), "max_len"),
        (dict(token_budget=0), "token_budget"),
        (dict(token_budget=16, token_buckets=(4, 8)), "token_buckets"),
        (dict(token_buckets=(0, 8)), "token_buckets"),
        (dict(max_slots=4, decode_buckets=(1, 2)), "decode_buckets"),
        (dict(decode_buckets=()), "decode_buckets"),
    ],
)
def test_engine_settings_are_checked_in_the_constructor(options, match):
    settings = dict(max_slots=2, max_len=32, token_budget=8) | options
    with pytest.raises(ValueError, match=match):
        Engine(model(), **settings)


def test_a_failed_or_interrupted_generate_gives_its_slots_back(small_engine, monkeypatch):
    m = model()
    prompts = random_prompts(np.random.default_rng(8), m.cfg.vocab_size, (5, 11, 3))
    expected = small_engine.generate(prompts, 4)
    for bad in (["ab"], [[1, 2], "ab"], [[1, 2.5]], [[1], [None]]):
        with pytest.raises(ValueError, match="prompt"):
            small_engine.generate(bad, 4)

    # An interrupt in the middle of a generation, after slots were taken and steps run.
    real_jitted, calls = small_engine.runner.step_program, []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_jitted(*args, **kwargs)

    monkeypatch.setattr(small_engine.runner, "step_program", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small_engine.generate(prompts, 4)
    monkeypatch.setattr(small_engine.runner, "step_program", real_jitted)
    assert small_engine.generate(prompts, 4) == expected


def test_slots_held_outside_generate_stop_it_with_an_error_not_a_hang():
    m = model()
    engine = Engine(m, max_slots=2, max_len=32, token_budget=8, kv_block_size=4, num_kv_blocks=8)
    prompts = random_prompts(np.random.default_rng(12), m.cfg.vocab_size, (5, 6))
    expected = engine.generate(prompts, 3)
    held = [engine.allocate_slot(), engine.allocate_slot()]
    with pytest.raises(RuntimeError, match="all 2 are held outside generate"):
        engine.generate(prompts, 3)
    engine.release_slot(held.pop())
    # The held slot's direct steps take 6 of the 8 pages: a request needing 3 never fits.
    for done in (0, 8, 16):
        engine.step(engine.builder.build([], [Request(held[0], [1] * 8, done)]))
    with pytest.raises(RuntimeError, match="1 slots held outside generate"):
        engine.generate(prompts, 8)
    engine.release_slot(held[0])
    assert engine.generate(prompts, 3) == expected


def test_out_of_range_token_ids_are_rejected_before_any_step(small_engine):
    vocab = model().cfg.vocab_size
    prefill_before = small_engine.stats["prefill_tokens"]
    for prompt, token in (([1, 2, vocab], vocab), ([3, -1], -1)):
        with pytest.raises(ValueError, match=rf"token id {token} .*vocab_size={vocab}"):
            small_engine.generate([[4, 5], prompt], 3)
        with pytest.raises(ValueError, match=rf"token id {token} is outside"):
            small_engine.builder.build([], [Request(0, prompt, 0)])
    assert small_engine.stats["prefill_tokens"] == prefill_before
    assert len(small_engine.generate([[4, 5], [vocab - 1]], 3)[1]) == 3


def test_no_prompts_or_no_new_tokens_give_empty_results(small_engine):
    assert small_engine.generate([], 4) == []
    assert small_engine.generate([[1, 2], [3]], 0) == [[], []]
    with pytest.raises(ValueError, match="max_new_tokens"):
        small_engine.generate([[1, 2]], -1)


def test_stats_split_decode_and_prefill_tokens_of_mixed_steps(small_engine):
    before = dict(small_engine.stats)
    mixed = small_engine.builder.build([Request(0, [5], 3)], [Request(1, [1] * 7, 0)])
    small_engine.step(mixed)
    delta = {k: small_engine.stats[k] - before[k] for k in before}
    assert (delta["decode_tokens"], delta["prefill_tokens"]) == (1, 7)
    assert delta["decode_seconds"] > 0
    assert delta["prefill_seconds"] == pytest.approx(7 * delta["decode_seconds"])

    # A generation with three prompts over two slots mixes decode rows and prefill chunks:
    # every prompt token is prefill, every generated token but the last is fed back as a
    # decode row.
    prompts = random_prompts(np.random.default_rng(9), model().cfg.vocab_size, (6, 9, 4))
    before = dict(small_engine.stats)
    generated = small_engine.generate(prompts, 5)
    assert small_engine.stats["prefill_tokens"] - before["prefill_tokens"] == 6 + 9 + 4
    assert small_engine.stats["decode_tokens"] - before["decode_tokens"] == sum(
        len(g) - 1 for g in generated
    )


def test_debug_log_has_a_line_per_step_with_its_buckets(small_engine, caplog):
    # Prompts of 6 and 9 tokens over two slots and an 8-token budget: the first step is
    # prefill only; later ones carry decode rows.
    prompts = random_prompts(np.random.default_rng(3), model().cfg.vocab_size, (6, 9))
    with caplog.at_level(logging.DEBUG, logger="flax_models.serving.loop"):
        generated = small_engine.generate(prompts, 3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: ")]
    steps = [
        tuple(map(int, re.findall(r"(\d+) (?:decode rows|prompt tokens)", line))) for line in lines
    ]
    assert steps[0] == (0, 8)  # the budget's 8 prompt tokens, no decode row yet
    assert sum(prompt for _, prompt in steps) == 6 + 9
    assert sum(decode for decode, _ in steps) == sum(len(g) - 1 for g in generated)
    assert all("bucket" in line and "ms later" in line for line in lines)


def test_max_prefill_seqs_caps_the_prompts_of_a_step_not_the_tokens(caplog):
    # Four 5-token prompts fit one 32-token step; two prefill rows take two steps, and the
    # greedy tokens are those of a step holding all four.
    prompts = random_prompts(np.random.default_rng(4), model().cfg.vocab_size, (5, 5, 5, 5))
    options = dict(max_slots=4, max_len=32, token_budget=32, decode_buckets=(4,))
    wide = Engine(model(), **options)
    assert wide.builder.prefill_seqs == 4  # min(16, max_slots)
    narrow = Engine(model(), max_prefill_seqs=2, **options)
    with caplog.at_level(logging.DEBUG, logger="flax_models.serving.loop"):
        generated = narrow.generate(prompts, 3)
    counts = [
        int(re.search(r"prompt tokens of (\d+) sequences", r.getMessage()).group(1))
        for r in caplog.records
        if r.getMessage().startswith("step: ")
    ]
    assert max(counts) == 2 and counts[:2] == [2, 2]
    assert generated == wide.generate(prompts, 3)
    with pytest.raises(ValueError, match="max_prefill_seqs"):
        Engine(model(), max_prefill_seqs=0, **options)


def test_bfloat16_ssm_cache_holds_the_float32_states_rounded():
    # A prompt's prefill from zero states accumulates in fp32 either way: the bf16 cache
    # holds the fp32 cache's states rounded; decode steps then continue from the rounded
    # states and stay close.
    prompt = random_prompts(np.random.default_rng(5), model().cfg.vocab_size, (13,))
    options = dict(max_slots=1, max_len=32, token_budget=16, decode_buckets=(1,))
    fp32, bf16 = (
        Engine(model(), mamba_ssm_cache_dtype=name, **options) for name in ("float32", "bfloat16")
    )
    assert Engine(model(), mamba_ssm_cache_dtype="auto", **options).caches[0].ssm_state.dtype == (
        model().dtype
    )

    def states(engine: Engine) -> list[np.ndarray]:
        return [
            np.asarray(c.ssm_state[0].astype(jnp.float32))
            for c in engine.caches
            if hasattr(c, "ssm_state")
        ]

    for engine in (fp32, bf16):
        engine.generate(prompt, 1)
    assert all(c.ssm_state.dtype == jnp.bfloat16 for c in bf16.caches if hasattr(c, "ssm_state"))
    for exact, rounded in zip(states(fp32), states(bf16), strict=True):
        assert np.abs(exact).max() > 0
        np.testing.assert_array_equal(rounded, exact.astype(jnp.bfloat16).astype(np.float32))
    for engine in (fp32, bf16):
        engine.generate(prompt, 4)
    for exact, rounded in zip(states(fp32), states(bf16), strict=True):
        assert_close(rounded, exact, rtol=1e-2, name="states after decode steps")
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        Engine(model(), mamba_ssm_cache_dtype="float16", **options)


def test_steps_from_32_rows_compile_without_triton_gemms():
    """Steps of at least ``CUBLAS_ONLY_MIN_ROWS`` token rows a device take the program
    compiled with XLA's Triton gemms off (cuBLAS only, measured faster to compile and to
    run there); smaller steps the plain one."""
    assert [step_xla_options(None, rows) for rows in (1, 16, CUBLAS_ONLY_MIN_ROWS - 1)] == [{}] * 3
    off = {"xla_gpu_enable_triton_gemm": False}
    assert step_xla_options(None, CUBLAS_ONLY_MIN_ROWS) == step_xla_options(None, 8192) == off
    engine = Engine(model(), max_slots=32, max_len=16, token_budget=32, decode_buckets=(1, 32))
    runner = engine.runner
    plain = [
        runner.program(engine.builder.build([Request(s, [3], 5) for s in range(rows)], []))
        is runner.step_program
        for rows in (1, 32)
    ]
    assert plain == [True, False]
