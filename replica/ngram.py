"""N-gram (prompt lookup) proposals: plain Python over a sequence's token ids, no model and no torch.

The sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min, are looked up earlier in the
sequence (prompt and output alike); at the latest earlier occurrence of the longest suffix found, the tokens that
followed it are proposed. Text that quotes or repeats itself (code edits, summaries, retrieval answers) is where
the proposals come true.

It runs for every speculating decode on every step, over its whole context: the search is bytes.rfind over the
token ids packed as 32-bit words (C speed, about a microsecond per thousand tokens), not a Python loop (a
millisecond)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WORD = 4  # bytes per token id in the packed haystack ('i': every vocabulary fits 31 bits)


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of lookup_min ..
    lookup_max tokens; [] when no such suffix occurs earlier."""
    size = len(tokens)
    if k < 1 or size < lookup_min + 1:
        return []
    packed = array("i", tokens).tobytes()
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        start = _rfind(packed, packed[(size - n) * _WORD :], (size - 1) * _WORD)
        if start is not None:  # an occurrence at start .. start + n - 1, with a token after it
            return list(tokens[start + n : min(start + n + k, size)])
    return []


def _rfind(haystack: bytes, needle: bytes, end: int) -> int | None:
    """The token index of the last occurrence of needle that lies within haystack[:end] on a token boundary."""
    while (at := haystack.rfind(needle, 0, end)) >= 0:
        if at % _WORD == 0:
            return at // _WORD
        end = at + len(needle) - 1  # a match across token boundaries: look further left
    return None


class NgramProposer:
    """speculative_config method ngram, as the engine's proposer: each sequence's proposals from its own tokens."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        return [propose(s.token_ids, n, self.lookup_min, self.lookup_max) if n else [] for s, n in zip(seqs, limits)]
