"""The replicas' tokenizer and chat template at the balancer, without torch or transformers: the `tokenizers` library
reads tokenizer.json and jinja2 renders the chat template in the sandbox transformers uses, with the same globals and
variables. The token ids serve only to hash a prompt's blocks for routing: an id that differs from the replica's
costs a cache hit, never a wrong answer.

What the replica does, and so what this mirrors (replica/prompts.py): text is `encode(text)` with the tokenizer's
special tokens; chat messages are `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`, then
`encode(rendered, add_special_tokens=False)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

log = logging.getLogger("fastgen.balancer")

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptTokenizer:
    """Encodes text and chat messages to the token ids a replica serving the model in `folder` would compute."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self._tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        config_path = self.folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._special = special_tokens_map(config)
        self._template_source = chat_template_of(self.folder, config)
        self._template = None

    @property
    def template_source(self) -> str | None:
        """The chat template's jinja source (the HTTP API picks its tool-call parser by it)."""
        return self._template_source

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_source)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """ValueError when the model has no template or the template refuses the messages (as the replica would)."""
        return self._tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def render_chat(self, messages: Sequence[dict]) -> str:
        if not self._template_source:
            raise ValueError("this model has no chat template")
        if self._template is None:
            try:
                self._template = compile_template(self._template_source)
            except Exception as e:  # noqa: BLE001 - not retried on every request
                log.warning("cannot compile the chat template of %s (%s): chat prompts route by text", self.folder, e)
                self._template_source = None
                raise ValueError(f"cannot compile the chat template: {e}") from e
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._special,
            )
        except Exception as e:  # noqa: BLE001 - the template's raise_exception and its own errors alike
            raise ValueError(f"the chat template refused the messages: {e}") from e


def load_prompt_tokenizer(folder: str | Path) -> PromptTokenizer | None:
    """The tokenizer in `folder`, or None (with a warning) when it has no tokenizer.json or it cannot be read."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        log.warning("no tokenizer.json in %s: prefix-aware routing hashes only token-id prompts", folder)
        return None
    try:
        return PromptTokenizer(folder)
    except Exception as e:  # noqa: BLE001 - a tokenizer we cannot read only costs routing precision
        log.warning(
            "cannot load the tokenizer in %s (%s): prefix-aware routing hashes only token-id prompts", folder, e
        )
        return None


def special_tokens_map(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, as transformers passes them to the chat template."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def chat_template_of(folder: Path, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else chat_template.json, else tokenizer_config.json's (a list
    of named templates gives the one named "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = None
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        template = json.loads(as_json.read_text()).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def compile_template(source: str):
    """A jinja2 template in transformers' sandbox: trim_blocks, lstrip_blocks, loop controls, raise_exception,
    strftime_now and a tojson that does not escape HTML."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}, which transformers uses to mark the assistant's tokens: renders
        its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
