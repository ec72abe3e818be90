"""Prompts in, token ids out: text, token-id lists and chat messages (rendered with the model's chat template),
checked so that a bad prompt is refused with a message saying what to change (no torch)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeGuard

CHAT_ROLES = ("system", "user", "assistant", "tool")
Prompt = str | Sequence[int] | Sequence[dict]


class ChatPrompt(list):
    """Chat messages with the tools the chat template renders (OpenAI's function definitions); a list of messages
    everywhere else, so that every seam that takes messages takes it."""

    def __init__(self, messages, tools: list[dict] | None = None) -> None:
        super().__init__(messages)
        self.tools = tools


def _all_messages(items: list) -> TypeGuard[list[dict]]:
    return all(isinstance(m, dict) for m in items)


def _all_token_ids(items: list) -> TypeGuard[list[int]]:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """An upper bound on the bytes of text one token stands for: the vocabulary's longest entry in UTF-8 (None
        for a tokenizer without a vocabulary, which takes token ids only)."""
        get_vocab = getattr(self.tokenizer, "get_vocab", None)
        if get_vocab is None:
            return None
        return max((len(t.encode()) for t in get_vocab()), default=None)

    def check_size(self, prompt: Prompt, max_tokens: int) -> None:
        """Refuses (ValueError), without tokenizing, a prompt that cannot fit in max_tokens tokens: more token ids or
        chat messages than that (each message renders to at least one token), or more text than max_tokens of the
        longest tokens hold. Tokenizing megabytes would stall the engine thread for seconds and hold millions of ids."""
        if isinstance(prompt, str):
            self._check_text_size(len(prompt), lambda: len(prompt.encode()), max_tokens)
            return
        items = prompt if isinstance(prompt, Sequence) else list(prompt)
        if len(items) > max_tokens:
            what = "chat messages" if items and isinstance(items[0], dict) else "tokens"
            raise ValueError(f"prompt has {len(items)} {what} but the context holds {max_tokens} tokens: shorten it")
        if items and isinstance(items[0], dict):
            contents = [m.get("content") for m in items if isinstance(m, dict)]
            texts = [c for c in contents if isinstance(c, str)]
            self._check_text_size(sum(map(len, texts)), lambda: sum(len(c.encode()) for c in texts), max_tokens)

    def _check_text_size(self, chars: int, utf8_bytes: Callable[[], int], max_tokens: int) -> None:
        if self.max_token_bytes is None:
            return
        limit = max_tokens * self.max_token_bytes
        # Characters never outnumber bytes, so a character count under a quarter of the limit needs no encoding.
        if chars > limit or (chars * 4 > limit and utf8_bytes() > limit):
            raise ValueError(
                f"prompt text is longer than {max_tokens} tokens (the context) could hold ({limit} bytes of UTF-8 at "
                f"most, the longest token having {self.max_token_bytes}): shorten the prompt"
            )

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids or chat messages ({role, content} dicts) -> token ids; ValueError on bad input."""
        return self.encode_with_text(prompt, want_text=False)[0]

    def encode_with_text(self, prompt: Prompt, want_text: bool = True) -> tuple[list[int], str]:
        """Token ids and the prompt as text (for echo): text as given, chat messages as the template rendered them,
        token ids decoded with their special tokens (only when want_text; '' otherwise)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: send some text, token ids or chat messages")
            return self._tokenize(prompt), prompt
        items = list(prompt)
        if not items:
            raise ValueError("prompt is empty: send some text, token ids or chat messages")
        if _all_messages(items):
            text = self.chat_text(items, getattr(prompt, "tools", None))
            return self._tokenize(text, add_special_tokens=False), text
        if not _all_token_ids(items):
            raise ValueError(
                "prompt must be a string, a list of token ids (ints) or a list of {role, content} messages"
            )
        bad = [t for t in items if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary: ids must be in [0, {self.vocab_size})")
        if not want_text:
            return items, ""
        return items, _as_value_error(
            "decode the prompt's token ids",
            lambda: self.tokenizer.decode(items, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        )

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Messages in the model's chat template, ending with the assistant's turn to speak."""
        return self._tokenize(self.chat_text(messages), add_special_tokens=False)

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The rendered chat template, as text; ValueError for a bad message or a model without a template."""
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"message {i} has unknown role {m.get('role')!r}: use one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs a string 'content'")
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template: send plain text or token ids instead of messages")
        return _as_value_error(
            "render the messages with the model's chat template (its own checks, such as alternating roles, may "
            "refuse them)",
            lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True
            ),
        )

    def _tokenize(self, text: str, **kwargs) -> list[int]:
        ids = _as_value_error("tokenize the prompt", lambda: self.tokenizer.encode(text, **kwargs))
        if not ids:  # text of only characters the tokenizer drops (control characters): nothing to compute from
            raise ValueError(
                f"prompt text {text[:40]!r} encodes to no tokens: send text with characters the tokenizer keeps"
            )
        return ids


def _as_value_error(what: str, call: Callable):
    """call(), with any failure of the tokenizer or template turned into the ValueError that refuses a request: a
    template's raise_exception or an odd input the tokenizer chokes on is the request's problem, and any other
    exception would escape to the engine thread."""
    try:
        return call()
    except ValueError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic in tokenizers (pyo3's PanicException) is a BaseException
        raise ValueError(f"could not {what}: {type(e).__name__}: {e}") from e
