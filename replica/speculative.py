"""Speculative decoding's seam between the engine and the scheduler (no torch). The settings, vLLM's
`speculative_config`, are SpeculativeConfig (config.py); the n-gram proposer is ngram.py; docs/speculative.md says
how proposals are verified within a SplitFuse pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import SpeculativeConfig
from .request import Sequence


@dataclass(frozen=True)
class Speculation:
    """What a scheduler speculates with: the settings, and the engine's proposer, (sequence, at most) -> tokens."""

    config: SpeculativeConfig
    propose: Callable[[Sequence, int], list[int]]
