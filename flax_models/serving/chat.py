"""Chat templates: a conversation rendered to prompt text the way transformers does it.

A Hugging Face directory ships its template as ``chat_template.jinja`` or as the
``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of named templates
of which ``"default"`` is used). It is rendered with jinja2 in a sandbox with transformers'
settings (``apply_chat_template``): ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the ``raise_exception`` and
``strftime_now`` globals; the variables are ``messages``, ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...), as strings. jinja2 is
imported on first use, so ``import flax_models`` does not need it.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

# tokenizer_config.json fields transformers passes to the template (its special tokens map).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


def load_chat_template(directory: str | Path, config: Mapping | None = None) -> str | None:
    """The directory's chat template (``chat_template.jinja`` first, then
    ``tokenizer_config.json``'s ``chat_template``), or None when it has none."""
    directory = Path(directory)
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    if config is None:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def special_tokens(config: Mapping) -> dict[str, object]:
    """The special tokens of a ``tokenizer_config.json`` as the template sees them (strings;
    a token written as ``{"content": ...}`` gives its content)."""

    def content(token):
        if isinstance(token, Mapping):
            return token.get("content")
        if isinstance(token, list):
            return [content(t) for t in token]
        return token

    return {name: content(config[name]) for name in _SPECIAL_TOKENS if name in config}


def _raise_exception(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja2's own tojson escapes HTML characters and ASCII-fies.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def check_messages(messages: object) -> list[dict]:
    """A conversation as a list of message dicts, each with a string ``role``;
    ``ValueError`` otherwise."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ValueError(
            "a conversation is a list of messages like {'role': 'user', 'content': 'Hi'}, "
            f"got {type(messages).__name__}"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {message!r}")
        checked.append(dict(message))
    return checked


def render_chat(
    template: str,
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = True,
    **variables: object,
) -> str:
    """``messages`` rendered by ``template`` (``variables``: the special tokens and any
    template option, e.g. ``tools``). A ``raise_exception`` in the template raises
    ``jinja2.TemplateError`` with its message, as in transformers."""
    return _compile(template).render(
        messages=check_messages(messages),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
