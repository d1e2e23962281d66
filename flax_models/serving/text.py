"""Text in, text out: a Hugging Face directory served through the engine.

``LLM(directory)`` loads the checkpoint (``load_hf_checkpoint``), its ``tokenizer.json``
(the Hugging Face ``tokenizers`` library, no transformers), the eos ids of
``generation_config.json``, ``config.json`` and ``tokenizer_config.json``, and the chat
template, and builds an ``Engine``. ``generate`` returns one ``Completion`` per prompt,
``stream`` yields the text of one request as its tokens are drawn, ``chat`` renders
conversations with the chat template first::

    llm = LLM("tests/fixtures/text", max_slots=4, max_len=128)
    out = llm.generate(["Hello", "The quick"], SamplingParams(max_new_tokens=8))
    for piece in llm.stream("Hello", SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])[0].text
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp

from flax_models.checkpoint import load_hf_checkpoint
from flax_models.serving import chat as chat_lib
from flax_models.serving.detokenize import IncrementalDetokenizer
from flax_models.serving.engine import Engine
from flax_models.serving.sampling import SamplingParams

Conversation = Sequence[Mapping[str, Any]]


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      text: the generated text (special tokens left out, cut before a stop string).
      token_ids: the generated token ids (the stopping eos or stop token included).
      finish_reason: ``"stop"`` (an eos or stop token, or a stop string) or ``"length"``
        (``max_new_tokens`` reached).
      stop_reason: what stopped it: the stop string, the stop token id, or None.
      prompt: the prompt text (a conversation's rendered text for ``chat``).
      prompt_token_ids: the prompt's token ids.
    """

    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    stop_reason: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)


def _eos_ids(value: object) -> set[int]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return {int(value)}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, numbers.Integral)}
    return set()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class LLM:
    """A Hugging Face checkpoint with its tokenizer, generating text.

    Args:
      directory: holds ``config.json``, ``*.safetensors`` and ``tokenizer.json``; optionally
        ``generation_config.json`` and ``tokenizer_config.json`` (eos ids, chat template).
      dtype: the weights' dtype (``A_log``, ``D``, ``dt_bias`` stay fp32).
      implementation: the kernels (``"auto"``, ``"xla"``, ``"triton"``, ``"mosaic"``).
      mesh: a ``jax.sharding.Mesh`` with an axis ``"tp"`` to shard the model and its caches
        over (tensor parallelism, ``flax_models.sharding``).
      **engine_options: ``Engine``'s (``max_slots``, ``max_len``, ``token_budget``, ...).

    Attributes:
      model, engine, tokenizer (``tokenizers.Tokenizer``), eos_token_ids (a frozenset: any
      of them ends a completion), chat_template (str or None).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        dtype: jnp.dtype = jnp.float32,
        implementation: str = "auto",
        mesh=None,
        **engine_options: Any,
    ):
        from tokenizers import Tokenizer

        directory = Path(directory)
        tokenizer_path = directory / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{tokenizer_path} not found: LLM needs a Hugging Face tokenizer.json beside "
                "the checkpoint (for token ids, use Engine)"
            )
        self.directory = directory
        self.model = load_hf_checkpoint(
            directory, dtype=dtype, implementation=implementation, mesh=mesh
        )
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        self._special_tokens = chat_lib.special_tokens(tokenizer_config)
        self.chat_template = chat_lib.load_chat_template(directory, tokenizer_config)
        # Any eos the checkpoint names ends a completion (as vLLM: the model config's, the
        # generation config's, which may list several, and the tokenizer's eos token).
        eos = _eos_ids(_read_json(directory / "config.json").get("eos_token_id"))
        eos |= _eos_ids(_read_json(directory / "generation_config.json").get("eos_token_id"))
        eos_token = self._special_tokens.get("eos_token")
        if isinstance(eos_token, str) and self.tokenizer.token_to_id(eos_token) is not None:
            eos.add(self.tokenizer.token_to_id(eos_token))
        self.eos_token_ids = frozenset(eos)
        self.engine = Engine(self.model, **engine_options)

    # ------------------------------------------------------------------------ prompts

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own BOS/EOS post-processing when
        ``add_special_tokens``)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Conversation, *, add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text of a conversation, rendered with the directory's chat template
        (``variables``: extra template variables, e.g. ``tools``)."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.directory} has no chat template (neither chat_template.jinja nor a "
                "'chat_template' in tokenizer_config.json); use generate() with plain text"
            )
        return chat_lib.render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **(self._special_tokens | variables),
        )

    def _text_prompts(self, prompts: str | Sequence[str]) -> tuple[list[str], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a string or a list of strings, got {prompts!r}")
        prompts = list(prompts)
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise ValueError(
                    f"prompt {i} is a {type(prompt).__name__}, not text; for token ids use "
                    "LLM.engine.generate"
                )
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
        ids = [e.ids for e in self.tokenizer.encode_batch(prompts, add_special_tokens=True)]
        return prompts, ids

    def _chat_prompts(
        self, messages: Conversation | Sequence[Conversation], add_generation_prompt: bool
    ) -> tuple[list[str], list[list[int]]]:
        # One conversation (a list of message dicts) or a list of them.
        one = isinstance(messages, Sequence) and (not messages or isinstance(messages[0], Mapping))
        conversations = [messages] if one else list(messages)
        texts = [
            self.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # The template writes the special tokens (BOS, role markers) itself.
        ids = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        return texts, ids

    @staticmethod
    def _params(
        sampling: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling is None or isinstance(sampling, SamplingParams):
            return [sampling or SamplingParams()] * count
        params = list(sampling)
        if len(params) != count:
            raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
        return params

    # ------------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[Completion]:
        """One ``Completion`` per prompt, in order. ``sampling``: one ``SamplingParams`` for
        all prompts, one per prompt, or None (greedy, 16 tokens). Every prompt and setting
        is checked (``ValueError``: empty text, too long for ``max_len``, ...) before any
        step runs. ``use_tqdm``: a progress bar over requests on stderr."""
        texts, ids = self._text_prompts(prompts)
        return self._generate(texts, ids, self._params(sampling, len(ids)), use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[Completion]:
        """Replies to one conversation (a list of ``{"role": ..., "content": ...}``) or to
        each of a list of them, rendered with the chat template: one ``Completion`` per
        conversation. ``ValueError`` when the directory has no chat template."""
        texts, ids = self._chat_prompts(messages, add_generation_prompt)
        return self._generate(texts, ids, self._params(sampling, len(ids)), use_tqdm)

    def stream(
        self,
        prompt: str | Conversation,
        sampling: SamplingParams | None = None,
    ) -> Iterator[str]:
        """Yields the text of one completion in pieces as its tokens are drawn (never half
        a character, never text a stop string may still remove); the pieces put together
        are ``generate``'s text. ``prompt``: text, or a conversation (rendered with the
        chat template). The generator returns the ``Completion`` (``StopIteration.value``).
        Checked before the first step, like ``generate``."""
        if isinstance(prompt, str):
            texts, ids = self._text_prompts(prompt)
        else:
            texts, ids = self._chat_prompts(prompt, True)
            if len(texts) != 1:
                raise ValueError("stream takes one prompt or one conversation")
        runner = _Run(self, texts, ids, self._params(sampling, 1))
        return _stream(runner)

    def _generate(
        self,
        texts: list[str],
        ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[Completion]:
        runner = _Run(self, texts, ids, params)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(texts), desc="generate", unit="request")
        try:
            for _index, _piece, done in runner:
                if done and bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return runner.completions()


class _Run:
    """One generation of text requests: iterating it runs the engine and yields
    ``(index, new text, finished)`` after each token."""

    def __init__(
        self,
        llm: LLM,
        texts: list[str],
        ids: list[list[int]],
        params: list[SamplingParams],
    ):
        self.texts, self.ids, self.params = texts, ids, params
        self.detokenizers = [
            IncrementalDetokenizer(llm.tokenizer, prompt, stop=p.stop)
            for prompt, p in zip(ids, params, strict=True)
        ]
        self.tokens: list[list[int]] = [[] for _ in ids]
        self.finish: list[str] = ["length"] * len(ids)  # max_new_tokens=0: "length", empty
        self.stop_reason: list[str | int | None] = [None] * len(ids)
        # Checks everything before the first step.
        self.events = llm.engine.stream(
            ids, params, eos_ids=llm.eos_token_ids, stop=self._add_token
        )

    def _add_token(self, index: int, token: int) -> bool:
        """The engine's host callback after each token that is not an eos/stop token."""
        return self.detokenizers[index].add(token)

    def __iter__(self) -> Iterator[tuple[int, str, bool]]:
        for index, token, reason in self.events:
            self.tokens[index].append(token)
            detokenizer = self.detokenizers[index]
            if reason is None:
                yield index, detokenizer.release(), False
                continue
            self.finish[index] = reason
            if detokenizer.stopped:
                self.stop_reason[index] = detokenizer.stop_string
            elif reason == "stop":
                self.stop_reason[index] = token
            yield index, detokenizer.finish(), True

    def completions(self) -> list[Completion]:
        for detokenizer in self.detokenizers:
            detokenizer.finish()
        return [
            Completion(
                text=d.text,
                token_ids=list(tokens),
                finish_reason=finish,
                stop_reason=stop_reason,
                prompt=text,
                prompt_token_ids=list(ids),
            )
            for d, tokens, finish, stop_reason, text, ids in zip(
                self.detokenizers,
                self.tokens,
                self.finish,
                self.stop_reason,
                self.texts,
                self.ids,
                strict=True,
            )
        ]


def _stream(runner: _Run) -> Iterator[str]:
    try:
        for _, piece, _ in runner:
            if piece:
                yield piece
    finally:
        runner.events.close()  # a consumer that stops early gives the slots back
    return runner.completions()[0]
