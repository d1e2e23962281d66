"""Text in, text out: a Hugging Face checkpoint served through the engine, with vLLM's names.

``LLM(model)`` loads the checkpoint (a local directory, or a Hub id found in the local
Hugging Face cache, offline), its ``tokenizer.json`` (the ``tokenizers`` library), the eos
ids and sampling defaults of ``generation_config.json``, and the chat template, and builds
an ``Engine`` that detokenises. ``generate`` returns one ``RequestOutput`` per prompt,
``chat`` renders conversations with the chat template first, ``stream`` yields the text of
one request as its tokens are drawn::

    llm = LLM("tests/fixtures/text", max_slots=4)
    outputs = llm.generate(["Hello", "The quick"], SamplingParams(max_tokens=8))
    outputs[0].outputs[0].text
    for piece in llm.stream("Hello", SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text
"""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.checkpoint import load_hf_checkpoint
from flax_models.config import HybridConfig
from flax_models.model import HybridLM
from flax_models.serving import chat as chat_lib
from flax_models.serving.engine import Engine
from flax_models.serving.inputs import check_sampling
from flax_models.serving.outputs import RequestOutput
from flax_models.serving.sampling import SamplingParams

__all__ = ["LLM", "resolve_model"]

Conversation = Sequence[Mapping[str, Any]]
Prompt = str | Mapping[str, Any]

_DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
}
# generation_config.json keys -> SamplingParams fields (the ones vLLM takes from it).
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
}
# How LLM gets its weights: from the safetensors, or random (vLLM's --load-format dummy).
LOAD_FORMATS = ("auto", "dummy")
# The KV cache an LLM may take by default: a share of the device's memory.
_CACHE_MEMORY_FRACTION = 0.3


def resolve_model(model: str | Path) -> Path:
    """``model`` as a local directory: the directory itself, or a Hugging Face Hub id
    (``"org/name"``) found in the local Hub cache (no network is used)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as error:
        raise ValueError(
            f"model={str(model)!r} is neither a directory nor a Hub id in the local Hugging "
            f"Face cache ({error})"
        ) from None


def resolve_dtype(dtype: object, config: Mapping[str, Any]):
    """The weights' dtype: ``"auto"`` is the config's ``dtype`` (``torch_dtype`` in older
    files; fp32 when neither is set), else a name or a JAX/NumPy dtype."""
    if isinstance(dtype, str):
        name = dtype
        if dtype == "auto":
            name = config.get("dtype") or config.get("torch_dtype") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    return jnp.dtype(dtype)


def _eos_ids(value: object) -> set[int]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return {int(value)}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, numbers.Integral)}
    return set()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class LLM:
    """A Hugging Face checkpoint with its tokenizer, generating text (vLLM's ``LLM``).

    Args:
      model: a directory holding ``config.json``, ``*.safetensors`` and (unless
        ``tokenizer`` says where) ``tokenizer.json``, or a Hub id in the local Hub cache;
        optionally ``generation_config.json`` (eos ids, sampling defaults) and
        ``tokenizer_config.json`` (eos token, chat template).
      dtype: the weights' dtype: ``"auto"`` (the config's), a name (``"bfloat16"``...) or
        a JAX dtype (``A_log``, ``D``, ``dt_bias`` stay fp32).
      tokenizer: a directory or Hub id of the tokenizer, when not ``model``'s.
      implementation: the kernels (``"auto"``, ``"xla"``, ``"triton"``, ``"mosaic"``).
      mesh: a ``jax.sharding.Mesh`` to shard the model and its caches over.
      max_model_len: tokens per sequence (prompt + generated); by default the config's
        ``max_position_embeddings``, capped so the KV pool takes at most a third of the
        device's memory (4096 for configs without one).
      seed: the seed of requests that give none.
      load_format: ``"auto"`` reads the safetensors; ``"dummy"`` (vLLM's name) builds the
        config's model with random weights instead, for benchmarks of shapes whose
        weights are not at hand (``config.json`` and the tokenizer are still read).
      **engine_options: ``Engine``'s (``max_slots``, ``token_budget``, ...).

    Attributes:
      model (the ``HybridLM``), engine (its ``Engine``), tokenizer
      (``tokenizers.Tokenizer``), eos_token_ids, chat_template (str or None),
      max_model_len, generation_defaults (the sampling defaults of
      ``generation_config.json``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: Any = "auto",
        tokenizer: str | Path | None = None,
        implementation: str = "auto",
        mesh=None,
        max_model_len: int | None = None,
        seed: int = 0,
        load_format: str = "auto",
        **engine_options: Any,
    ):
        from tokenizers import Tokenizer

        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: expected one of {LOAD_FORMATS}")

        directory = resolve_model(model)
        tokenizer_dir = directory if tokenizer is None else resolve_model(tokenizer)
        tokenizer_path = tokenizer_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{tokenizer_path} not found: LLM needs a Hugging Face tokenizer.json beside "
                "the checkpoint or tokenizer= (for token ids, use Engine)"
            )
        if "max_len" in engine_options:
            if max_model_len is not None:
                raise ValueError("give max_model_len or the engine's max_len, not both")
            max_model_len = engine_options.pop("max_len")
        self.directory = directory
        config = _read_json(directory / "config.json")
        if load_format == "dummy":
            self.model = HybridLM(
                HybridConfig.from_hf(config),
                dtype=resolve_dtype(dtype, config),
                implementation=implementation,
                mesh=mesh,
                rngs=nnx.Rngs(seed),
            )
        else:
            self.model = load_hf_checkpoint(
                directory,
                dtype=resolve_dtype(dtype, config),
                implementation=implementation,
                mesh=mesh,
            )
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        tokenizer_config = _read_json(tokenizer_dir / "tokenizer_config.json")
        self._special_tokens = chat_lib.special_tokens(tokenizer_config)
        self.chat_template = chat_lib.load_chat_template(tokenizer_dir, tokenizer_config)
        generation = _read_json(directory / "generation_config.json")
        # Any eos the checkpoint names ends a completion (as vLLM: the model config's, the
        # generation config's, which may list several, and the tokenizer's eos token).
        eos = _eos_ids(config.get("eos_token_id")) | _eos_ids(generation.get("eos_token_id"))
        eos_token = self._special_tokens.get("eos_token")
        if isinstance(eos_token, str) and self.tokenizer.token_to_id(eos_token) is not None:
            eos.add(self.tokenizer.token_to_id(eos_token))
        self.eos_token_ids = frozenset(eos)
        self.generation_defaults = {
            field: generation[key]
            for key, field in _GENERATION_DEFAULTS.items()
            if key in generation
        }
        self.max_model_len = self._model_len(max_model_len, config, engine_options)
        self.engine = Engine(
            self.model,
            max_len=self.max_model_len,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            seed=seed,
            **engine_options,
        )
        self._ids = itertools.count()

    def _model_len(self, requested: int | None, config: Mapping[str, Any], options) -> int:
        if requested is not None:
            return requested
        length = config.get("max_position_embeddings") or 4096
        cfg = self.model.cfg
        attention_layers = sum(kind in "*P" for kind in cfg.layer_pattern)
        stats = jax.devices()[0].memory_stats() or {}
        if attention_layers and "bytes_limit" in stats:
            per_token = 2 * attention_layers * cfg.num_kv_heads * cfg.head_dim
            per_token *= jnp.dtype(self.model.dtype).itemsize
            slots = options.get("max_slots", 8)
            fits = int(_CACHE_MEMORY_FRACTION * stats["bytes_limit"]) // (per_token * slots)
            length = max(1, min(length, fits))
        return int(length)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's ``generation_config.json`` defaults."""
        return SamplingParams().with_defaults(self.generation_defaults)

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

    def _prompts(self, prompts: Prompt | Sequence[Prompt]) -> list[tuple[str | None, list[int]]]:
        """``(text, token ids)`` of each prompt: a string, or ``{"prompt_token_ids": ids}``
        (optionally with ``"prompt"``)."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a string or a list of strings, got {prompts!r}")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, Mapping):
                if "prompt_token_ids" not in prompt:
                    raise ValueError(f"prompt {i}: a dict prompt needs 'prompt_token_ids'")
                out.append((prompt.get("prompt"), list(prompt["prompt_token_ids"])))
                continue
            if not isinstance(prompt, str):
                raise ValueError(
                    f"prompt {i} is a {type(prompt).__name__}, not text or "
                    "{'prompt_token_ids': [...]}"
                )
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            out.append((prompt, self.encode(prompt)))
        return out

    def _chat_prompts(
        self, messages: Conversation | Sequence[Conversation], add_generation_prompt: bool
    ) -> list[tuple[str, list[int]]]:
        # One conversation (a list of message dicts) or a list of them.
        one = isinstance(messages, Sequence) and (not messages or isinstance(messages[0], Mapping))
        conversations = [messages] if one else list(messages)
        texts = [
            self.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # The template writes the special tokens (BOS, role markers) itself.
        return [(text, self.encode(text, add_special_tokens=False)) for text in texts]

    def _params(
        self, sampling: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        params = check_sampling(sampling, count, default=SamplingParams())
        return [p.with_defaults(self.generation_defaults) for p in params]

    # ------------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in order. ``sampling_params``: one for
        all prompts, one per prompt, or None (``default_sampling_params``). Every prompt
        and setting is checked (``ValueError``: empty text, too long, ...) before any step
        runs. ``use_tqdm``: a progress bar over requests on stderr."""
        prompts = self._prompts(prompts)
        return self._run(prompts, self._params(sampling_params, len(prompts)), use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Replies to one conversation (a list of ``{"role": ..., "content": ...}``) or to
        each of a list of them, rendered with the chat template: one ``RequestOutput`` per
        conversation. ``ValueError`` when the directory has no chat template."""
        prompts = self._chat_prompts(messages, add_generation_prompt)
        return self._run(prompts, self._params(sampling_params, len(prompts)), use_tqdm)

    def stream(
        self, prompt: str | Conversation, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yields the text of one completion in pieces as its tokens are drawn (never half
        a character, never text a stop string may still remove); the pieces put together
        are ``generate``'s text. ``prompt``: text, or a conversation (rendered with the
        chat template). The generator returns the ``RequestOutput``
        (``StopIteration.value``). Checked before the first step, like ``generate``."""
        if isinstance(prompt, str):
            prompts = self._prompts(prompt)
        else:
            prompts = self._chat_prompts(prompt, True)
            if len(prompts) != 1:
                raise ValueError("stream takes one prompt or one conversation")
        (params,) = self._params(sampling_params, 1)
        if params.n != 1:
            raise ValueError(f"stream gives one completion; n={params.n}")
        (request_id,) = self._add(prompts, [params])
        return self._stream(request_id)

    def _stream(self, request_id: str) -> Iterator[str]:
        sent = 0
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    text = output.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if output.finished:
                        return output
        finally:
            self.engine.abort_request(request_id)  # a consumer that stops early

    def _add(self, prompts: list[tuple[str | None, list[int]]], params) -> list[str]:
        """Adds the requests (all or none: a bad one aborts those added before it)."""
        ids: list[str] = []
        try:
            for (text, token_ids), p in zip(prompts, params, strict=True):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p, prompt=text)
                ids.append(request_id)
        except BaseException as error:
            for request_id in ids:
                self.engine.abort_request(request_id)
            if isinstance(error, ValueError) and len(prompts) > 1:
                raise ValueError(f"prompt {len(ids)}: {error}") from None
            raise
        return ids

    def _run(self, prompts, params, use_tqdm: bool) -> list[RequestOutput]:
        ids = self._add(prompts, params)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="request")
        try:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in ids:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id in ids]
