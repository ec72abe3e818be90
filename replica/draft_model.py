"""speculative_config method draft_model: proposals from a smaller model with the same vocabulary, run greedily in
the same process over a KV cache of its own.

The draft's cache has as many blocks as the target's and is indexed by the same block ids: the scheduler's block
tables serve both, so allocation, preemption and freeing need nothing of their own. What the draft's KV holds is
`Sequence.num_draft_computed` tokens; before proposing, the draft catches up on the rest (a prompt just prefilled,
a recompute after a preemption, the tokens accepted and emitted since), as one chunk per sequence in one pass that
also gives its first proposal; each further proposal is a decode pass over the sequences that want one more. The
draft writes the KV of its own proposals at their positions (the scheduler allocated those blocks): once the
target's verification settles, the scheduler keeps as computed only those accepted. Blocks the draft shares through
the prefix cache or a fork are recomputed into, with the same tokens, rather than trusted: nothing records whether a
cached block's draft KV was ever written."""

from __future__ import annotations

import torch

from .batch import Batch, ScheduledSeq
from .model_runner import ModelRunner
from .request import Sequence


class DraftProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # the draft's, on this process alone (no tensor parallelism, no CUDA graphs)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        active = [(s, n) for s, n in zip(seqs, limits) if n > 0]
        if not active:
            return [[] for _ in seqs]
        # The catch-up pass: one-token chunks first, as a batch's decodes are.
        active.sort(key=lambda a: a[0].num_tokens - a[0].num_draft_computed > 1)
        chunks = [
            ScheduledSeq(s.seq_id, s.token_ids[s.num_draft_computed :], s.num_draft_computed, s.block_table, True)
            for s, _ in active
        ]
        drafts = {s.seq_id: [t] for (s, _), t in zip(active, self._greedy(chunks))}
        for s, _ in active:
            s.num_draft_computed = s.num_tokens
        for j in range(1, max(n for _, n in active)):
            more = [s for s, n in active if n > j]
            step = [
                ScheduledSeq(s.seq_id, drafts[s.seq_id][-1:], s.num_tokens + j - 1, s.block_table, True) for s in more
            ]
            for s, t in zip(more, self._greedy(step)):
                drafts[s.seq_id].append(t)
                s.num_draft_computed += 1  # the proposal's KV: counted until verification settles it
        return [drafts.get(s.seq_id, []) for s in seqs]

    def _greedy(self, seqs: list[ScheduledSeq]) -> list[int]:
        batch = Batch(seqs, sum(len(s.token_ids) == 1 for s in seqs), [])
        return self.runner.forward(batch).argmax(dim=-1).tolist()
