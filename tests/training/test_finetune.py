"""``python -m flax_models.finetune``: label masks of chat examples, a short run that lowers
the loss and saves a checkpoint equal to the trained model, LoRA runs that train the
adapters alone, and errors that name the bad line or argument. The CLI runs in-process."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from flax_models import load_hf_checkpoint
from flax_models.lora import load_lora_adapter, merge_lora
from flax_models.training import IGNORE_INDEX
from flax_models.training.finetune import main, parse_args, run
from flax_models.training.sft_data import (
    TextFormat,
    encode_chat,
    encode_text,
    make_batches,
    read_examples,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "text"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Bye now"},
    {"role": "assistant", "content": "See you"},
]
TEXT = "The quick brown fox jumps over the lazy dog."
IDS = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def fmt() -> TextFormat:
    return TextFormat.from_directory(FIXTURE)


def tokens(fmt: TextFormat, text: str) -> list[int]:
    return fmt.tokenizer.encode(text, add_special_tokens=False).ids


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def flat(model) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))
    }


def test_chat_labels_score_only_the_assistant_turns(fmt):
    ids, labels = encode_chat(fmt, CHAT)
    assert ids == tokens(fmt, fmt.render(CHAT, add_generation_prompt=False))
    # Independently, by token counts: each assistant turn spans from the end of the prompt
    # before it (with the generation prompt) to the end of the conversation through it.
    expected = np.full(len(ids), IGNORE_INDEX)
    for i, message in enumerate(CHAT):
        if message["role"] == "assistant":
            prompt = tokens(fmt, fmt.render(CHAT[:i], add_generation_prompt=True))
            through = tokens(fmt, fmt.render(CHAT[: i + 1], add_generation_prompt=False))
            assert ids[: len(prompt)] == prompt and ids[: len(through)] == through
            expected[len(prompt) : len(through)] = ids[len(prompt) : len(through)]
    np.testing.assert_array_equal(labels, expected)
    scored = [t for t in labels if t != IGNORE_INDEX]
    text = fmt.tokenizer.decode(scored, skip_special_tokens=False)
    assert text == "Hello there<|end|>\nSee you<|end|>\n"


def test_text_scores_every_token_and_batches_pad_with_unscored_rows(fmt):
    example = encode_text(fmt, TEXT)
    assert example.input_ids == fmt.tokenizer.encode(TEXT).ids == example.labels
    chat = encode_chat(fmt, CHAT)
    ((input_ids, labels),) = make_batches([example, chat], batch_size=3, length=40, pad_id=0)
    assert input_ids.shape == labels.shape == (3, 40)
    np.testing.assert_array_equal(labels[1, : len(chat.labels)], chat.labels)
    assert (labels[0, len(example.labels) :] == IGNORE_INDEX).all()
    assert (labels[2] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        {"prompt": "neither format"},
        {"text": "", "messages": []},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
    ],
)
def test_a_bad_line_is_named(fmt, tmp_path, bad):
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": TEXT}, "", bad, {"text": TEXT}])
    with pytest.raises(ValueError, match=r"data\.jsonl line 3: "):
        read_examples(data, fmt)


def test_cli_errors_name_the_line_and_the_argument(tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": TEXT}, {"messages": "hi"}])
    out = str(tmp_path / "out")
    level = logging.getLogger("flax_models").level  # main sets it for its messages
    try:
        with pytest.raises(SystemExit, match="line 2"):
            main([str(FIXTURE), "--data", str(data), "--output", out])
    finally:
        logging.getLogger("flax_models").setLevel(level)
    for option, value in [("--epochs", "0"), ("--eval-fraction", "1"), ("--max-len", "1")]:
        with pytest.raises(SystemExit) as error:
            parse_args([str(FIXTURE), "--data", str(data), "--output", out, option, value])
        assert error.value.code == 2 and option in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([str(FIXTURE), "--data", str(tmp_path / "missing.jsonl"), "--output", out])
    assert "--data" in capsys.readouterr().err
    # Chat needs a template: a copy of the fixture without one.
    plain = shutil.copytree(FIXTURE, tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"text": TEXT}, {"messages": CHAT}])
    with pytest.raises(ValueError, match="line 2: .*chat template"):
        read_examples(chat, TextFormat.from_directory(plain))
    assert not (tmp_path / "out").exists()


def dataset(tmp_path: Path) -> Path:
    """Two examples repeated: 10 lines, so the default holds one out."""
    return write_jsonl(tmp_path / "data.jsonl", 5 * [{"text": TEXT}, {"messages": CHAT}])


def finetune(tmp_path: Path, *options: str):
    out = tmp_path / "out"
    argv = [str(FIXTURE), "--data", str(dataset(tmp_path)), "--output", str(out)]
    argv += ["--batch-size", "4", "--max-len", "40", "--implementation", "xla", *options]
    model, log = run(parse_args(argv), progress=False)
    return model, log, out


def test_a_short_run_lowers_the_loss_and_saves_the_trained_model(tmp_path):
    model, log, out = finetune(tmp_path, "--epochs", "3", "--learning-rate", "3e-3")
    assert log["examples"] == {"train": 9, "eval": 1, "truncated": 0, "dropped": 0}
    assert json.loads((out / "finetune_log.json").read_text()) == log
    losses = [entry["loss"] for entry in log["train"]]
    assert len(losses) == log["steps"] == 3 * 3
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1
    evals = [entry["step"] for entry in log["eval"]]
    assert evals == [0, 3, 6, 9]  # before, every epoch, at the end
    assert log["eval"][-1]["loss"] < log["eval"][0]["loss"] - 0.1
    assert np.isclose(log["eval"][-1]["perplexity"], np.exp(log["eval"][-1]["loss"]))
    assert (out / "tokenizer.json").is_file() and not (out / "adapter").exists()
    saved = load_hf_checkpoint(out, implementation="xla")
    logits = nnx.jit(lambda m, ids: m(ids))  # one compilation for both (a plain call: two)
    np.testing.assert_array_equal(np.asarray(logits(saved, IDS)), np.asarray(logits(model, IDS)))


def test_lora_trains_the_adapters_alone_and_saves_them_merged(tmp_path):
    """The saved weights are the original base plus the saved adapter, merged: had any
    base weight moved in training, the saved one would differ from it by that much."""
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2"]
    model, log, out = finetune(tmp_path, *lora, "--eval-fraction", "0")  # no eval compile
    assert log["examples"]["train"] == 10 and log["eval"] == [] and log["steps"] == 3
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    base = flat(load_hf_checkpoint(FIXTURE, implementation="xla"))
    saved = flat(load_hf_checkpoint(out, implementation="xla"))
    rebuilt = load_hf_checkpoint(FIXTURE, implementation="xla")
    rebuilt = flat(merge_lora(load_lora_adapter(rebuilt, out / "adapter")))
    assert saved.keys() == base.keys() == rebuilt.keys() == flat(model).keys()
    moved = {name for name in base if not np.array_equal(saved[name], base[name])}
    assert moved and all(name.endswith("kernel") for name in moved)  # the adapted projections
    for name in base:
        np.testing.assert_allclose(saved[name], rebuilt[name], rtol=1e-6, atol=1e-7, err_msg=name)
