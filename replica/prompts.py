"""Prompts in, token ids out: text, token-id lists and chat messages (rendered with the model's chat template),
checked so that a bad prompt is refused with a message saying what to change (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

CHAT_ROLES = ("system", "user", "assistant", "tool")
Prompt = str | Sequence[int] | Sequence[dict]


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids or chat messages ({role, content} dicts) -> token ids; ValueError on bad input."""
        return self.encode_with_text(prompt, want_text=False)[0]

    def encode_with_text(self, prompt: Prompt, want_text: bool = True) -> tuple[list[int], str]:
        """Token ids and the prompt as text (for echo): text as given, chat messages as the template rendered them,
        token ids decoded with their special tokens (only when want_text; '' otherwise)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: send some text, token ids or chat messages")
            return self.tokenizer.encode(prompt), prompt
        items = list(prompt)
        if not items:
            raise ValueError("prompt is empty: send some text, token ids or chat messages")
        if all(isinstance(m, dict) for m in items):
            text = self.chat_text(items)
            return self.tokenizer.encode(text, add_special_tokens=False), text
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError(
                "prompt must be a string, a list of token ids (ints) or a list of {role, content} messages"
            )
        bad = [t for t in items if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary: ids must be in [0, {self.vocab_size})")
        if not want_text:
            return items, ""
        return items, self.tokenizer.decode(items, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Messages in the model's chat template, ending with the assistant's turn to speak."""
        return self.tokenizer.encode(self.chat_text(messages), add_special_tokens=False)

    def chat_text(self, messages: list[dict]) -> str:
        """The rendered chat template, as text; ValueError for a bad message or a model without a template."""
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"message {i} has unknown role {m.get('role')!r}: use one of {', '.join(CHAT_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs a string 'content'")
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template: send plain text or token ids instead of messages")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
