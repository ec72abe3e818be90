"""Incremental detokenization: new text after every token, never half a multi-byte character."""

from __future__ import annotations

# Prompt tokens decoded along with the output, so the first generated token gets its leading space right.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], keep_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = not keep_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] is the context the next delta is decoded against
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Returns the text that token_id completes ('' while a character is still partial)."""
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""
