"""Supervised fine-tuning data: JSONL examples tokenised with label masks, cut, split and
padded into batches for ``loss_fn`` (``flax_models.training.finetune`` trains on them).

Each line of a file is one example (blank lines are skipped):

- ``{"text": "..."}``: plain text, tokenised as ``LLM.encode`` does (with the tokenizer's
  own special tokens); every token is a target.
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation, rendered with the
  directory's chat template (``flax_models.serving.chat``) and tokenised without added
  special tokens (the template writes them), as ``LLM.chat`` does. Only the assistant
  turns' tokens are targets; every other label is :data:`IGNORE_INDEX`. Turn ``i``'s span
  is the text that rendering the conversation through it adds to rendering the turns
  before it with the generation prompt: the prompt is not scored, the end-of-turn marker
  is (the model learns to stop)::

      render(messages[:i], add_generation_prompt=True)
          <|bos|><|user|>Hi<|end|>\\n<|assistant|>
      render(messages[:i + 1])
          <|bos|><|user|>Hi<|end|>\\n<|assistant|>Hello<|end|>\\n
                                               ^^^^^^^^^^^^^^ scored

  A token is a target when its first character lies in a span (a token that straddles
  a span's start, which BPE may merge, is not).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from flax_models.serving import chat as chat_lib
from flax_models.training.losses import IGNORE_INDEX, pad_sequences

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class Example(NamedTuple):
    """One tokenised example: ``input_ids[n]`` and ``labels[n]``, the token where it is a
    target and :data:`IGNORE_INDEX` where it is not (``loss_fn``'s convention: the logits
    at ``t`` are scored against ``labels[t + 1]``)."""

    input_ids: list[int]
    labels: list[int]


@dataclasses.dataclass(frozen=True)
class TextFormat:
    """What tokenising an example needs: the directory's ``tokenizer.json``, its chat
    template (None without one) and the special tokens the template sees."""

    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: Mapping[str, object]

    @classmethod
    def from_directory(cls, directory: str | Path) -> TextFormat:
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: fine-tuning on text needs a tokenizer.json")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(
            Tokenizer.from_file(str(path)),
            chat_lib.load_chat_template(directory, config),
            chat_lib.special_tokens(config),
        )

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise ValueError("a 'messages' example needs a chat template; the model has none")
        return chat_lib.render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def encode_text(fmt: TextFormat, text: str) -> Example:
    """Plain text → an :class:`Example` scoring every token."""
    ids = fmt.tokenizer.encode(text).ids
    return Example(ids, list(ids))


def assistant_spans(fmt: TextFormat, messages: Sequence[Mapping]) -> tuple[str, list[range]]:
    """The conversation's text and the character ranges of its assistant turns (module
    docstring). ``ValueError`` for a template that does not render a conversation as its
    earlier prefixes (each rendering must start with the one before it)."""
    full = fmt.render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = fmt.render(messages[:i], add_generation_prompt=True)
        through = fmt.render(messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(
                f"the chat template does not render message {i} after the ones before it "
                "(its rendering of the conversation so far is not a prefix of the whole), "
                "so the assistant turn's tokens cannot be told apart"
            )
        spans.append(range(len(before), len(through)))
    return full, spans


def encode_chat(fmt: TextFormat, messages: object) -> Example:
    """A conversation → an :class:`Example` scoring only its assistant turns' tokens."""
    messages = chat_lib.check_messages(messages)
    for i, message in enumerate(messages):
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} needs a string 'content', got {message!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message (nothing to learn)")
    text, spans = assistant_spans(fmt, messages)
    encoding = fmt.tokenizer.encode(text, add_special_tokens=False)
    ids = encoding.ids
    scored = [any(start in span for span in spans) for start, _ in encoding.offsets]
    return Example(ids, [t if s else IGNORE_INDEX for t, s in zip(ids, scored, strict=True)])


def encode_record(fmt: TextFormat, record: object) -> Example:
    """One JSONL record (``{"text": ...}`` or ``{"messages": [...]}``) → an :class:`Example`."""
    if not isinstance(record, Mapping) or len({"text", "messages"} & record.keys()) != 1:
        raise ValueError('an example is an object with one of "text" or "messages"')
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError(f'"text" must be a non-empty string, got {record["text"]!r}')
        return encode_text(fmt, record["text"])
    return encode_chat(fmt, record["messages"])


def read_examples(path: str | Path, fmt: TextFormat) -> list[Example]:
    """Every example of a JSONL file, tokenised; ``ValueError`` naming the file and line of
    the first bad one (not JSON, neither format, a template that fails)."""
    import jinja2

    examples = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                examples.append(encode_record(fmt, json.loads(line)))
            except (ValueError, jinja2.TemplateError) as error:  # JSONDecodeError included
                raise ValueError(f"{path} line {number}: {error}") from None
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def truncate(examples: Sequence[Example], max_len: int) -> tuple[list[Example], dict[str, int]]:
    """Examples cut to ``max_len`` tokens, without those that then score no target (a
    target needs a token before it); counts ``truncated`` and ``dropped`` with them."""
    kept, truncated = [], 0
    for ids, labels in examples:
        truncated += len(ids) > max_len
        ids, labels = ids[:max_len], labels[:max_len]
        if any(label != IGNORE_INDEX for label in labels[1:]):
            kept.append(Example(ids, labels))
    return kept, {"truncated": truncated, "dropped": len(examples) - len(kept)}


def split(
    examples: Sequence[Example], eval_fraction: float, rng: np.random.Generator
) -> tuple[list[Example], list[Example]]:
    """``(train, held out)``: a random ``eval_fraction`` of the examples (at least one when
    it is above 0) held out, at least one left to train on."""
    held = 0 if eval_fraction == 0 else max(1, round(eval_fraction * len(examples)))
    if held >= len(examples):
        raise ValueError(
            f"--eval-fraction {eval_fraction} holds out {held} of {len(examples)} examples, "
            "leaving none to train on"
        )
    order = rng.permutation(len(examples))
    return [examples[i] for i in order[held:]], [examples[i] for i in order[:held]]


def make_batches(
    examples: Sequence[Example], *, batch_size: int, length: int, pad_id: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Examples in order → ``(input_ids[B, L], labels[B, L])`` batches, ``B = batch_size``,
    ``L = length``, right-padded (``pad_sequences``); the last batch is filled with rows of
    ``pad_id`` that score nothing, so every batch has one shape."""
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        input_ids, labels = pad_sequences(
            [e.input_ids for e in chunk], length=length, pad_id=pad_id
        )
        for row, example in enumerate(chunk):
            labels[row, : len(example.labels)] = example.labels
        fill = batch_size - len(chunk)
        input_ids = np.pad(input_ids, ((0, fill), (0, 0)), constant_values=pad_id)
        labels = np.pad(labels, ((0, fill), (0, 0)), constant_values=IGNORE_INDEX)
        batches.append((input_ids, labels))
    return batches
