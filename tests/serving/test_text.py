"""Text in, text out: LLM, streaming, stop strings, eos, chat, the generate CLI.

The fixture ``tests/fixtures/text/`` is the tiny GraniteMoeHybrid checkpoint with a byte-level
BPE tokenizer of 256 tokens (``tools/make_tokenizer_fixture.py``), a chat template and two
eos ids. Its random weights make greedy decoding repeat one token; the tests read what the
model generates instead of hard-coding text.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

# The text path's own dependencies (in pyproject.toml); a bare JAX image may lack them.
pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

from flax_models import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from flax_models.serving import cli as generate_cli  # noqa: E402
from flax_models.serving.chat import render_chat  # noqa: E402
from flax_models.serving.detokenize import IncrementalDetokenizer  # noqa: E402

TEXT = Path(__file__).parent.parent / "fixtures" / "text"
UNICODE = "Café 😀 日本語 🚀★ naïve → ok"


def _completions(outputs: list[RequestOutput]) -> list[types.SimpleNamespace]:
    """Each finished request's first completion, with its request's prompt fields."""
    done = []
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished
        (completion,) = output.outputs
        assert isinstance(completion, CompletionOutput)
        done.append(
            types.SimpleNamespace(
                **vars(completion),
                prompt=output.prompt,
                prompt_token_ids=output.prompt_token_ids,
            )
        )
    return done


def generate(llm: LLM, prompts, sampling=None):
    return _completions(llm.generate(prompts, sampling, use_tqdm=False))


def chat(llm: LLM, messages, sampling=None):
    return _completions(llm.chat(messages, sampling, use_tqdm=False))


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One LLM for the module: fixed buckets keep it to three compiled programs."""
    return LLM(
        TEXT,
        implementation="xla",
        max_slots=4,
        max_len=64,
        token_budget=16,
        decode_buckets=(4,),
        token_buckets=(16,),
    )


def pieces_of(tokenizer, ids, **options) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, **options)
    pieces = []
    for token in ids:
        detokenizer.add(token)
        pieces.append(detokenizer.release())
    pieces.append(detokenizer.finish())
    return pieces, detokenizer


# ---------------------------------------------------------------- detokenisation


def test_incremental_detokenizer_never_splits_a_character(llm):
    ids = llm.encode(UNICODE)
    assert llm.decode(ids) == UNICODE
    # The emoji and CJK characters span several byte tokens in this tokenizer.
    assert any(llm.decode([t]).endswith("\ufffd") for t in ids)
    pieces, detokenizer = pieces_of(llm.tokenizer, ids)
    assert "".join(pieces) == detokenizer.text == UNICODE
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # an incomplete character waited for its next token


def test_a_stop_string_across_token_boundaries_cuts_the_text(llm):
    text = "Hello world! The fox"
    ids = llm.encode(text)
    assert [llm.decode([t]) for t in ids[:3]] == ["Hel", "lo", " wor"]
    detokenizer = IncrementalDetokenizer(llm.tokenizer, stop=["lo wo"])
    stopped_at = next(i for i, t in enumerate(ids) if detokenizer.add(t))
    assert stopped_at == 2  # "Hel" + "lo" + " wor" completes "lo wo"
    assert detokenizer.finish() == "Hel" and detokenizer.text == "Hel"
    assert detokenizer.stop_string == "lo wo"


def test_streamed_text_holds_back_a_possible_stop_string_start(llm):
    text = "The fox runs on. The dog sleeps"
    ids = llm.encode(text)
    pieces, detokenizer = pieces_of(llm.tokenizer, ids, stop=["fox!", "dog."])
    assert detokenizer.text == "".join(pieces) == text and not detokenizer.stopped
    released = ""
    for piece in pieces[:-1]:
        released += piece
        assert not released.endswith(("f", "fo", "fox", "d", "do", "dog"))


# ---------------------------------------------------------------- generate


def test_generate_returns_one_completion_per_prompt_in_order(llm):
    prompts = ["Hello world", UNICODE, "The quick brown fox", "Once upon a time", "x"]
    completions = generate(llm, prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert [c.prompt for c in completions] == prompts
    engine_ids = llm.engine.generate([llm.encode(p) for p in prompts], 6)
    for completion, ids in zip(completions, engine_ids, strict=True):
        assert completion.token_ids == ids and completion.finish_reason == "length"
        assert completion.text == llm.decode(ids)
    single = generate(llm, "Hello world", SamplingParams(temperature=0.0, max_new_tokens=6))
    assert len(single) == 1 and single[0].token_ids == completions[0].token_ids
    assert (
        generate(llm, ["a", "b"], SamplingParams(temperature=0.0, max_new_tokens=0))[1].token_ids
        == []
    )


def test_stop_string_ends_a_completion_and_is_cut_from_its_text(llm):
    greedy = generate(
        llm, "The quick brown fox", SamplingParams(temperature=0.0, max_new_tokens=8)
    )[0]
    # This random model repeats one two-character token: "xo" needs two of them.
    token_text = llm.decode(greedy.token_ids[:1])
    assert len(token_text) == 2 and greedy.text == token_text * 8
    stop = token_text[1] + token_text[0]
    stopped = generate(
        llm,
        "The quick brown fox",
        SamplingParams(temperature=0.0, max_new_tokens=8, stop=["never", stop]),
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == token_text[0]
    assert stopped.token_ids == greedy.token_ids[:2]


def test_eos_and_stop_token_ids_end_a_completion(llm):
    assert llm.eos_token_ids == {2, 6}  # generation_config.json lists two
    greedy = generate(llm, "Hello world", SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    token = greedy.token_ids[0]
    stopped = generate(
        llm,
        "Hello world",
        SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[token]),
    )
    assert stopped[0].token_ids == [token] and stopped[0].text == ""
    assert stopped[0].finish_reason == "stop" and stopped[0].stop_reason == token
    eos_ids = llm.eos_token_ids
    try:
        llm.engine.eos_token_ids = eos_ids | {token}  # as if the checkpoint's eos were this
        assert generate(llm, "Hello world", SamplingParams(temperature=0.0))[0].token_ids == [token]
        ignored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert generate(llm, "Hello world", ignored)[0].token_ids == greedy.token_ids[:3]
    finally:
        llm.engine.eos_token_ids = eos_ids


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"generation_config.json": {"eos_token_id": 5}}, {2, 5}),
        ({"generation_config.json": {"eos_token_id": [3, 4]}}, {2, 3, 4}),
        ({"tokenizer_config.json": {"eos_token": "<|end|>"}}, {2, 6}),
        ({}, {2}),
    ],
)
def test_eos_ids_come_from_the_checkpoint_configs(tmp_path, files, expected):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to((TEXT / name).resolve())
    for name, payload in files.items():
        (tmp_path / name).write_text(json.dumps(payload))
    assert LLM(tmp_path, implementation="xla").eos_token_ids == expected


def test_empty_and_over_long_prompts_raise_before_any_step(llm):
    before = (llm.engine.compile_count, dict(llm.engine.stats))
    for prompts, match in (
        ("", "prompt 0 is empty"),
        (["fine", ""], "prompt 1 is empty"),
        (["fine", "word " * 40], "prompt 1: .* exceed max_len=64"),
        ([b"bytes"], "not text"),
        ([[1, 2, 3]], "not text"),
    ):
        with pytest.raises(ValueError, match=match):
            generate(llm, prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    with pytest.raises(ValueError, match="exceed max_len=64"):
        generate(llm, "Hello", SamplingParams(temperature=0.0, max_new_tokens=64))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        generate(llm, "Hello", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)])
    with pytest.raises(ValueError, match="empty"):
        llm.stream("")
    assert (llm.engine.compile_count, dict(llm.engine.stats)) == before


def test_stream_gives_the_text_of_generate(llm):
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=3)
    expected = generate(llm, UNICODE, sampling)[0]
    stream = llm.stream(UNICODE, sampling)
    pieces = []
    with pytest.raises(StopIteration) as done:
        while True:
            pieces.append(next(stream))
    assert "".join(pieces) == expected.text and all(pieces)
    (returned,) = _completions([done.value.value])  # the generator returns the RequestOutput
    assert returned == expected
    # With a stop string taken from the middle of that text.
    middle = expected.text[len(expected.text) // 2 :][:3]
    assert len(middle) == 3
    stopped = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=3, stop=[middle])
    completion = generate(llm, UNICODE, stopped)[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == middle
    assert completion.text == expected.text[: expected.text.index(middle)]
    assert "".join(llm.stream(UNICODE, stopped)) == completion.text


def test_a_stream_abandoned_early_gives_its_slots_back(llm):
    sampling = SamplingParams(max_new_tokens=30, temperature=1.0, seed=1)
    stream = llm.stream("Hello", sampling)
    next(stream)
    stream.close()
    assert llm.engine.num_free_slots == llm.engine.builder.num_slots


# ---------------------------------------------------------------- sampling through the LLM


def test_sampled_tokens_do_not_depend_on_the_batch(llm):
    """A request's tokens depend on its own seed and prompt: alone or third of four (other
    prompts, seeds and settings around it), the same tokens."""
    target = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, seed=11)
    alone = generate(llm, "Once upon a time", target)[0].token_ids
    batch = generate(
        llm,
        ["Hello world", UNICODE, "Once upon a time", "The quick brown fox"],
        [
            SamplingParams(max_new_tokens=4, temperature=0.7, seed=11),
            SamplingParams(max_new_tokens=12, top_p=0.5, temperature=1.2, seed=5),
            target,
            SamplingParams(temperature=0.0, max_new_tokens=10),
        ],
    )
    assert batch[2].token_ids == alone
    assert len(set(alone)) > 1  # sampled, not the greedy repetition


def test_same_seed_same_tokens_other_seed_other_tokens(llm):
    def run(seed):
        sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed)
        return generate(llm, ["Hello world", "Hello world"], sampling)

    first, again, other = run(0), run(0), run(1)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert first[0].token_ids == first[1].token_ids  # same seed, same prompt
    assert first[0].token_ids != other[0].token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = generate(llm, UNICODE, SamplingParams(temperature=0.0, max_new_tokens=6))[0].token_ids
    for sampling in (
        SamplingParams(max_new_tokens=6, temperature=1.5, top_k=1, seed=4),
        SamplingParams(max_new_tokens=6, temperature=0.8, top_p=1e-6, seed=4),
    ):
        assert generate(llm, UNICODE, sampling)[0].token_ids == greedy


# ---------------------------------------------------------------- chat


def test_chat_applies_the_template_like_transformers(llm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! 😀"},
    ]
    rendered = llm.apply_chat_template(messages)
    assert rendered == "<|bos|><|system|>Be brief.<|end|>\n<|user|>Hi! 😀<|end|>\n<|assistant|>"
    (reply,) = chat(llm, messages, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert reply.prompt == rendered
    assert reply.prompt_token_ids == llm.encode(rendered, add_special_tokens=False)
    assert reply.prompt_token_ids[:2] == [1, 5]  # <|bos|> <|system|>: special tokens
    replies = chat(llm, [messages, messages[1:]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert replies[0].token_ids == reply.token_ids and len(replies) == 2
    assert llm.apply_chat_template(messages, add_generation_prompt=False).endswith("<|end|>\n")
    with pytest.raises(jinja2.TemplateError, match="unknown role: robot"):
        chat(llm, [{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="'role'"):
        chat(llm, [{"content": "no role"}])


def test_render_chat_uses_transformers_jinja_settings():
    template = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {{ m['role'] }}: {{ m['content'] | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    messages = [{"role": "user", "content": "é"}, {"role": "bot", "content": "<b>"}, {"role": "x"}]
    text = render_chat(template, messages, eos_token="</s>")
    # trim_blocks and lstrip_blocks drop the block-tag lines (not an expression's indent);
    # loopcontrols gives break; tojson keeps non-ASCII and HTML characters as they are.
    assert text == '  user: "é"\n  bot: "<b>"\n</s>'


def test_chat_without_a_template_is_a_clear_error(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to((TEXT / name).resolve())
    llm = LLM(tmp_path, implementation="xla")
    with pytest.raises(ValueError, match="no chat template"):
        chat(llm, [{"role": "user", "content": "Hi"}])


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    shutil.copy(TEXT / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(tmp_path)
    with pytest.raises(ValueError, match="mesh"):
        LLM(TEXT, mesh=object())


def test_load_format_dummy_builds_the_config_with_random_weights(tmp_path, llm):
    # No safetensors in the directory: "dummy" needs none, "auto" does.
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(TEXT / name, tmp_path)
    dummy = LLM(tmp_path, implementation="xla", load_format="dummy")
    loaded = {k: np.asarray(v) for k, v in _flat_params(llm.model).items()}
    drawn = {k: np.asarray(v) for k, v in _flat_params(dummy.model).items()}
    assert drawn.keys() == loaded.keys()
    assert all(drawn[k].shape == loaded[k].shape for k in drawn)
    assert any(not np.array_equal(drawn[k], loaded[k]) for k in drawn)
    with pytest.raises(ValueError, match="load_format"):
        LLM(TEXT, load_format="safetensors")


def _flat_params(model) -> dict[str, object]:
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): var[...] for path, var in nnx.to_flat_state(state)}


# ---------------------------------------------------------------- the CLI


def test_generate_cli_streams_a_completion(llm, monkeypatch, capsys):
    monkeypatch.setattr(generate_cli, "LLM", lambda *args, **kwargs: llm)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=2)
    expected = generate(llm, "Hello world", sampling)[0].text
    argv = [str(TEXT), "--prompt", "Hello world", "--max-new-tokens", "12"]
    assert generate_cli.main([*argv, "--temperature", "0.8", "--top-p", "0.9", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(expected + "\n") and "tokens/s" in out
    generate_cli.main([str(TEXT), "--prompt", "Hi", "--chat", "--max-new-tokens", "3"])
    assert "finish_reason" in capsys.readouterr().out


def test_generate_cli_runs_a_prompts_file(llm, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(generate_cli, "LLM", lambda *args, **kwargs: llm)
    prompts = ["Hello world", "", UNICODE, "The fox", "Once", "upon"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    argv = [str(TEXT), "--prompts-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "5"]
    generate_cli.main(argv)
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    kept = [p for p in prompts if p]
    assert [r["prompt"] for r in records] == kept and [r["index"] for r in records] == [
        0,
        1,
        2,
        3,
        4,
    ]
    greedy = generate(llm, kept, SamplingParams(temperature=0.0, max_new_tokens=5))
    assert [r["text"] for r in records] == [c.text for c in greedy]
    assert "tokens/s" in captured.err and "5/5" in captured.err  # tqdm over requests


def test_engine_takes_prompts_as_lists_or_integer_arrays(llm):
    import jax.numpy as jnp

    engine = llm.engine
    ids = [[5, 6, 7, 8], [9, 10, 11, 12]]
    expected = engine.generate(ids, 3)
    for prompts in (
        np.asarray(ids, np.int32),
        jnp.asarray(ids),
        [np.asarray(p, np.int64) for p in ids],
        [jnp.asarray(p) for p in ids],
        (tuple(p) for p in ids),
    ):
        assert engine.generate(prompts, 3) == expected
    for prompts, match in (
        ([5, 6, 7], "flat list of token ids"),
        (np.asarray([5, 6, 7]), "flat array of 3 token ids"),
        (np.zeros((1, 2, 3), np.int32), "2-D"),
        ([[5.0, 6.0]], "int token ids"),
        (np.asarray(ids, np.float32), "int token ids"),
        ([jnp.asarray([1.5, 2.0])], "int token ids"),
        ([[True, False]], "int token ids"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, 3)
