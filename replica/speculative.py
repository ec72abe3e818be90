"""Speculative decoding's seam between the engine and the scheduler (no torch). The settings, vLLM's
`speculative_config`, are SpeculativeConfig (config.py); the proposers are ngram.py and draft_model.py;
docs/speculative.md says how proposals are verified within a SplitFuse pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import SpeculativeConfig
from .request import Sequence

# The weight a verify's counts keep in AcceptanceRate per later verify: about the last 50 count.
ACCEPTANCE_DECAY = 0.98


@dataclass
class AcceptanceRate:
    """The share of proposed tokens accepted lately, from decaying counts; a half before any (the prior's weight is
    two proposals, so the first verifies move it at once)."""

    proposed: float = 2.0
    accepted: float = 1.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed = self.proposed * ACCEPTANCE_DECAY + proposed
        self.accepted = self.accepted * ACCEPTANCE_DECAY + accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed


@dataclass(frozen=True)
class Speculation:
    """What a scheduler speculates with: the settings, and the engine's proposer: (sequences, at most how many tokens
    for each) -> the tokens proposed for each. KV blocks for the proposals are allocated before it is called (a draft
    model writes its own KV at their positions)."""

    config: SpeculativeConfig
    propose: Callable[[list[Sequence], list[int]], list[list[int]]]
