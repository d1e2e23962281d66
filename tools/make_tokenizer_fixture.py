"""Makes ``tests/fixtures/text/``: a tiny model fixture with a tokenizer, for the text path.

    .venv/bin/python tools/make_tokenizer_fixture.py tests/fixtures/text \\
        --model tests/fixtures/granitemoehybrid

Copies the model fixture's ``config.json`` and ``model.safetensors`` (a random tiny
GraniteMoeHybrid, vocab 256) and writes beside them, with the Hugging Face ``tokenizers``
library (no transformers):

- ``tokenizer.json``: a byte-level BPE (GPT-2 style pre-tokenizer and decoder) trained on
  the short text below to exactly the model's vocabulary size, with special tokens
  ``<unk> <|bos|> <|eos|> <|user|> <|assistant|> <|system|> <|end|>`` as ids 0-6 (so
  ``<|eos|>`` is the config's ``eos_token_id=2``). Only the bytes of the training text are
  in its alphabet (256 byte tokens would not leave room for merges); other bytes encode as
  ``<unk>``. Characters that occur once (the emoji, some CJK) stay split over several
  byte tokens, which is what the incremental detokeniser's tests need.
- ``tokenizer_config.json``: the special tokens and a small chat template.
- ``generation_config.json``: several eos ids, ``[2, 6]`` (``<|eos|>`` and ``<|end|>``).

The output is deterministic (same files every run); the tests read the committed files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<unk>",
    "<|bos|>",
    "<|eos|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
]

# Short, mixed text: English prose for merges, every printable ASCII character, and some
# accented Latin, CJK and emoji (multi-byte UTF-8).
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.",
    "Hello world! Hello there, how are you? I am fine, thank you. How is the weather?",
    "Once upon a time there was a small model that wanted to write stories about the sea.",
    "It read the words one by one, and then it wrote them again, token after token.",
    "State space models and attention layers work together in a hybrid language model.",
    "A language model reads a prompt and writes a completion; the completion stops at a",
    "stop string, at the end of its tokens, or when the model writes its end token.",
    "Streaming text arrives piece by piece, and the pieces together are the whole text.",
    "The sampler keeps the most likely tokens, then draws one of them with its own seed.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 -7 +8 = 15% of $20.",
    string.printable,
    "Café, naïve, résumé, über, straße, œuvre, déjà vu, crème brûlée, São Paulo.",
    "日本語のテキスト。こんにちは世界。東京と大阪。",
    "Emoji: 😀 🚀 ✓ ★ → ∑ π ≈ 3.14159",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="e.g. tests/fixtures/text")
    parser.add_argument("--model", required=True, help="model fixture to copy, vocab >= 200")
    args = parser.parse_args()
    out, model = Path(args.out_dir), Path(args.model)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    vocab_size = config["vocab_size"]
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(model / name, out / name)

    tokenizer = train(vocab_size)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:  # every id the model can draw decodes to something
        raise SystemExit(f"tokenizer has {size} tokens; the model's vocab is {vocab_size}")
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, token
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)

    tokenizer_config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config.get("max_position_embeddings", 256),
    }
    generation_config = {
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": [tokenizer.token_to_id("<|eos|>"), tokenizer.token_to_id("<|end|>")],
        "pad_token_id": config.get("pad_token_id", 0),
    }
    for name, payload in (
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ):
        (out / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    print(f"{out}: tokenizer of {size} tokens for a model of vocab {vocab_size}")


if __name__ == "__main__":
    main()
