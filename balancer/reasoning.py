"""Reasoning models' thoughts on the chat API (--reasoning-parser): the <think> ... </think> block of the output goes
to the message's reasoning_content (vLLM's field), the rest to content, streamed too.

- qwen3: thoughts only inside an explicit <think> block at the start; without one, everything is content;
- deepseek_r1: its chat template opens the block itself, so the output starts inside it: everything up to </think>
  is reasoning (and, when no </think> ever comes, all of it).
Pure: no I/O, no torch."""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output."""
    body = text.lstrip()
    if body.startswith(OPEN):
        body = body[len(OPEN) :]
    elif parser == "qwen3":
        return None, text
    thoughts, closed, rest = body.partition(CLOSE)
    if not closed:
        return thoughts, None
    return thoughts.strip("\n") or None, rest.lstrip("\n") or None


@dataclass
class ReasoningStream:
    """One choice's streamed text as deltas of reasoning_content, then content. Text that may begin a marker is held
    back until it is known not to."""

    parser: str
    text: str = ""
    sent: int = 0  # characters of text sent
    state: str = "start"  # start (undecided) | thinking | content

    def feed(self, new: str, finished: bool) -> list[dict]:
        self.text += new
        out: list[dict] = []
        if self.state == "start":
            head = self.text.lstrip()
            if OPEN.startswith(head) and len(head) < len(OPEN) and not finished:
                return out  # may still become <think>
            if head.startswith(OPEN):
                self.state, self.sent = "thinking", self.text.index(OPEN) + len(OPEN)
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "content"
        if self.state == "thinking":
            at = self.text.find(CLOSE, self.sent)
            end = at if at >= 0 else len(self.text) - (0 if finished else _partial(self.text, CLOSE))
            if end > self.sent:
                out.append({"reasoning_content": self.text[self.sent : end]})
                self.sent = end
            if at < 0:
                return out
            self.state, self.sent = "content", at + len(CLOSE)
        if self.sent < len(self.text):
            out.append({"content": self.text[self.sent :]})
            self.sent = len(self.text)
        return out


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
