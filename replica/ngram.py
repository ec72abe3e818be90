"""N-gram (prompt lookup) proposals: plain Python over a sequence's token ids, no model and no torch.

The sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min, are looked up earlier in the
sequence (prompt and output alike); at the latest earlier occurrence of the longest suffix found, the tokens that
followed it are proposed. Text that quotes or repeats itself (code edits, summaries, retrieval answers) is where
the proposals come true."""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of lookup_min ..
    lookup_max tokens; [] when no such suffix occurs earlier."""
    size = len(tokens)
    if k < 1 or size < lookup_min + 1:
        return []
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        suffix = list(tokens[size - n :])
        last = suffix[-1]
        # Latest match first: the most recent context is the likeliest to repeat. i is where a match would end.
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == suffix:
                return list(tokens[end + 1 : min(end + 1 + k, size)])
    return []
