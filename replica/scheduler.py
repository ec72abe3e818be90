"""Dynamic SplitFuse scheduler and the two baseline schedules of the paper's comparison (no torch).

Each `schedule()` call builds one forward pass. Sequences keep FCFS priority: older sequences are served first
and, when the KV pool runs short, the newest sequence is preempted (its blocks freed; it is recomputed later). A
sequence that already has output (preempted, or resumed from a replica that failed) waits ahead of those that have
not started.
The scheduler advances `num_computed` as it schedules: the batch it returns is what the model will cache.
A sequence forked from another (`fork`: the n completions of one prompt) shares its parent's full KV blocks and starts
on a copy of the partly filled last one, which the next batch carries for the model runner to copy before its forward
pass.

With prefix caching a sequence admitted from the queue first takes the longest chain of cached blocks of its tokens
and computes only the rest, at least its last token (so there are logits to sample from); that cached prefix costs no
token budget. Where every layer has a sliding window (`kv_window`) it need not start from block 0: a sequence can start
after any full block whose blocks its next query can still see are cached, however many before them were evicted; its
table names the blocks before those as entries that alias its first shared one and hold nothing, as blocks released
outside the window do (`num_released`). A block is published as soon as the batch that fills it is built, so a
request admitted later in the same batch can share it: every layer writes the batch's KV before its attention reads
the cache. A block's hash chains over the tokens before it, not over cached blocks, so a sequence that skipped blocks
publishes the ones it computes under the same hashes as one that computed them all.

With speculative decoding (`speculation`, set by the engine) a decode may carry tokens proposed for it, to be verified
in the same pass, while the budget lasts after every decode has its token and before prompt chunks get theirs. The
proposals take only free blocks (nothing is preempted for them) and are not counted as computed: once the step's
tokens are out, `observe` counts the accepted ones, publishes the blocks they fill and frees the rest.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .batch import Batch, ScheduledSeq
from .block_allocator import BlockAllocator
from .config import SchedulerConfig
from .lora_pool import LoraPool
from .prefix_cache import extend_hashes
from .request import SeqStatus, Sequence
from .speculative import AcceptanceRate, Speculation


@dataclass
class PrefixStats:
    """Prefix-cache activity since the last `Scheduler.prefix_stats()`."""

    queries: int = 0  # tokens of sequences admitted from the queue, looked up in the cache
    hits: int = 0  # of those, tokens found cached (with kv_window, those before the blocks found too: not computed)
    evictions: int = 0  # cached blocks handed out again


@dataclass
class CachedPrefix:
    """The cached blocks a waiting sequence can start from: its blocks skipped .. skipped + len(blocks) - 1 are
    `blocks`, shared; the `skipped` before them (only with kv_window) hold keys that no query from there on can see,
    and need not be cached: the table names them as aliases of blocks[0] holding no reference (num_released)."""

    skipped: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Table entries the prefix covers: its tokens are num_blocks * block_size."""
        return self.skipped + len(self.blocks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, loras: LoraPool | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.loras = loras  # the LoRA adapter slots, with --enable-lora
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted sequences go back to the front
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        self._overtakes = 0
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next batch
        self._prefix = PrefixStats()
        self._evictions_seen = allocator.num_evictions
        self._watermark_blocks = max(1, int(allocator.num_blocks * config.watermark)) if config.watermark else 0
        self._schedule = self._schedules()[config.policy]
        self.speculation: Speculation | None = None  # set by an engine that speculates
        self.acceptance = AcceptanceRate()  # of the proposals verified lately

    def _schedules(self) -> dict[str, Callable[[], Batch]]:
        """The schedules this class builds, by policy name (a subclass adds its own)."""
        return {
            "splitfuse": self._schedule_splitfuse,
            "prefill_first": self._schedule_prefill_first,
            "static": self._schedule_static,
        }

    # ---- admission and release -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuses (ValueError) a request that could never run, whatever else is going on."""
        total = num_prompt_tokens + max_new_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"context of {self.config.max_model_len} tokens: shorten the prompt or lower max_new_tokens"
            )
        need = self.allocator.blocks_for(total)
        window = self.config.kv_window
        if window is not None and self.config.policy in ("splitfuse", "slo"):
            # Chunked prompts: a sequence holds the blocks from the one its window starts in to its latest chunk's
            # last, window + block_size - 1 + max_batch_tokens tokens at most, however long it runs.
            need = min(need, self.allocator.blocks_for(window + self.config.max_batch_tokens) + 1)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {total} tokens needs {need} KV blocks but the whole pool has "
                f"{self.allocator.num_blocks}: lower max_new_tokens or shorten the prompt (or give the server a "
                "larger KV cache)"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.max_new_tokens)
        seq.status = SeqStatus.WAITING
        if not seq.mid_stream:
            self.waiting.append(seq)
            return
        # Resumed from a replica that failed: its client is mid-stream, as a preempted sequence's is, so it goes
        # ahead of every request that has not started (behind those that had, in the order they came).
        at = next((i for i, s in enumerate(self.waiting) if not s.mid_stream), len(self.waiting))
        self.waiting.insert(at, seq)

    def finish(self, seq: Sequence) -> None:
        """Releases a sequence that finished or was aborted, wherever it is."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def fork(self, parent: Sequence, children: list[Sequence]) -> int:
        """Starts children, each holding the tokens parent has computed: they share parent's full KV blocks and get
        a copy of its partly filled last one (copied before the next forward pass). A child that finds no free block
        for that copy or max_seqs running waits instead, with nothing computed, and is recomputed from its tokens as
        a preempted sequence is. Returns how many share parent's KV."""
        num_tokens = parent.num_computed
        full = num_tokens // self.allocator.block_size
        released = min(parent.num_released, full)  # given back outside the window: the children need them no more
        shared_blocks = parent.block_table[released:full]
        partial = parent.block_table[full : self.allocator.blocks_for(num_tokens)]
        watermark = self._watermark_blocks
        shared = 0
        for child in children:
            child.block_hashes = list(parent.block_hashes)  # the same tokens so far
            room = len(partial) + watermark <= self.allocator.num_free and len(self.running) < self.config.max_seqs
            if not room:
                break
            self._hold_adapter(child)  # the parent's, resident while the parent runs
            child.block_table += [-1] * released  # aliases, set below once the child holds a block past them
            self.allocator.share(child.block_table, shared_blocks)
            new_blocks = self.allocator.allocate(child.block_table, num_tokens)
            assert new_blocks is not None, "room for the partial block's copy was checked above"
            self._copies += zip(partial, new_blocks)
            child.block_table[:released] = [child.block_table[released]] * released
            child.num_released = released
            child.num_computed = num_tokens
            child.status = SeqStatus.RUNNING
            self.running.append(child)
            shared += 1
        for child in children[shared:]:
            child.num_computed = 0
            child.status = SeqStatus.WAITING
        self.waiting.extendleft(reversed(children[shared:]))  # ahead of newer requests, in index order
        return shared

    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache activity since the previous call."""
        stats, self._prefix = self._prefix, PrefixStats()
        stats.evictions = self.allocator.num_evictions - self._evictions_seen
        self._evictions_seen = self.allocator.num_evictions
        return stats

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        if self.config.kv_window is not None:
            for seq in self.running:
                self._release_outside_window(seq)
        batch = self._schedule()
        if self._copies and batch:
            batch, self._copies = dataclasses.replace(batch, copies=self._copies), []
        if self.loras is not None and batch:
            batch = dataclasses.replace(batch, lora_loads=self.loras.drain_loads())
        return batch

    def observe(self, batch: Batch) -> None:
        """Called by the engine once the step that ran `batch` has sampled and emitted its tokens. The fixed
        schedules learn nothing from it; verified sequences settle."""
        verified = {s.seq_id: s.num_draft for s in batch.seqs if s.num_draft}
        for seq in [s for s in self.running if s.seq_id in verified] if verified else ():
            self._settle(seq, verified[seq.seq_id])

    def _settle(self, seq: Sequence, proposed: int) -> None:
        """A verified sequence after its step: every token but the last emitted one is computed (its decode token
        and the accepted proposals); the blocks those fill are published and those past its tokens freed."""
        start = seq.num_computed
        seq.num_computed = seq.num_tokens - 1
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)  # the draft's KV of rejected tokens
        self.acceptance.add(proposed, seq.num_computed - start)
        self._publish(seq, start)
        self.allocator.shrink(seq.block_table, seq.num_tokens)

    def refuse_for(self) -> float | None:
        """Seconds new requests should wait before retrying while the scheduler sheds load; None: admit them."""
        return None

    # ---- the three schedules ---------------------------------------------------------------------------
    def _schedule_splitfuse(self) -> Batch:
        """Every decode gets one token; prompt chunks (unfinished prompts first, then new requests in arrival
        order) fill the rest of the budget, splitting a prompt that does not fit."""
        scheduled: set[int] = set()
        decoding = self._decode_all(scheduled)
        decodes, verifies = self._speculate(decoding.seqs, self.config.max_batch_tokens - len(decoding.seqs))
        chunks, preempted = list(verifies), list(decoding.preempted)
        budget = self.config.max_batch_tokens - len(decodes) - sum(len(v.token_ids) for v in verifies)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in scheduled or seq.num_uncomputed <= 1:
                continue
            chunk = self._continue_prompt(seq, min(seq.num_uncomputed, budget), scheduled, preempted)
            if chunk is not None:
                chunks.append(chunk)
                budget -= len(chunk.token_ids)
        if not preempted:  # a pool short enough to preempt admits nothing new this step
            chunks += self._admit(budget, scheduled, whole_prompts=False)
        return Batch(decodes + chunks, len(decodes), preempted)

    def _schedule_prefill_first(self) -> Batch:
        """vLLM's scheduler of 2023: whole new prompts whenever any can be admitted, decodes wait meanwhile."""
        scheduled: set[int] = set()
        prefills = self._admit(self.config.max_batch_tokens, scheduled, whole_prompts=True)
        if prefills:
            return Batch(prefills, 0, [])
        return self._decode_all(scheduled)

    def _schedule_static(self) -> Batch:
        """Static batching: a batch is admitted only when the previous one has finished, then runs to the end."""
        scheduled: set[int] = set()
        if self.running:
            return self._decode_all(scheduled)
        prefills = self._admit(self.config.max_batch_tokens, scheduled, whole_prompts=True, reserve_lifetime=True)
        return Batch(prefills, 0, [])

    # ---- pieces ----------------------------------------------------------------------------------------
    def _decode_all(self, scheduled: set[int]) -> Batch:
        decodes, preempted = [], []
        for seq in list(self.running):
            if seq.status is SeqStatus.RUNNING and seq.num_uncomputed == 1:
                if self._make_room(seq, seq.num_tokens, scheduled, preempted, preempt_self=True):
                    decodes.append(self._take(seq, 1, scheduled))
        return Batch(decodes, len(decodes), preempted)

    def _speculate(self, decodes: list[ScheduledSeq], budget: int) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """(plain decodes, verifies): the decodes, oldest first, extended by the tokens proposed for them while
        `budget` (tokens beyond the decodes' own) lasts, when the step is worth it. A proposal never lets a sequence
        pass max_new_tokens, even if every token is accepted, and takes only free blocks."""
        spec = self.speculation
        if spec is None or not decodes or not spec.config.speculates(len(self.running)):
            return decodes, []
        by_id = {s.seq_id: s for s in self.running}
        asked: list[Sequence] = []
        limits: list[int] = []
        for d in decodes:
            seq = by_id[d.seq_id]
            room = self.allocator.tokens_fitting(seq.block_table, seq.num_computed)
            limit = min(spec.config.num_speculative_tokens, budget, seq.max_tokens - seq.num_tokens - 1, room)
            if limit > 0:
                self.allocator.allocate(seq.block_table, seq.num_computed + limit)
                asked.append(seq)
                limits.append(limit)
                budget -= limit
        proposed = spec.propose(asked, limits) if asked else []
        drafts = {s.seq_id: p[:n] for s, p, n in zip(asked, proposed, limits) if p}
        if drafts and not self._worth_verifying(decodes, drafts):
            drafts = {}
        plain, verifies = [], []
        for d in decodes:
            seq = by_id[d.seq_id]
            draft = drafts.get(d.seq_id, [])
            self.allocator.shrink(seq.block_table, seq.num_computed + len(draft))  # the blocks proposals left unused
            if not draft:
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)  # a draft's proposals, unused
                plain.append(d)
                continue
            block_table = list(seq.block_table)
            verifies.append(
                dataclasses.replace(d, token_ids=d.token_ids + draft, block_table=block_table, num_draft=len(draft))
            )
        return plain, verifies

    def _worth_verifying(self, decodes: list[ScheduledSeq], drafts: dict[int, list[int]]) -> bool:
        """Whether the step verifies the tokens proposed for these decodes (by seq id). The fixed schedules have no
        step-time model to ask: they always do, disable_by_batch_size aside."""
        return True

    def _admit(
        self, budget: int, scheduled: set[int], whole_prompts: bool, reserve_lifetime: bool = False
    ) -> list[ScheduledSeq]:
        """Moves waiting sequences to running while the budget, max_seqs and the KV pool allow, and schedules them.

        A request that does not fit now may be overtaken by later ones, at most `max_overtakes` times."""
        admitted: list[ScheduledSeq] = []
        claimed = 0  # blocks promised to static sequences admitted by this call, beyond those they hold already
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_seqs:
            seq = self.waiting[i]
            hits = self._cached_prefix(seq)
            cached = hits.num_blocks * self.allocator.block_size
            n = seq.num_tokens - cached if whole_prompts else min(seq.num_tokens - cached, budget)
            if whole_prompts and n > budget and admitted:
                break  # whole prompts only; the first one may exceed the budget so it can run at all
            need = self.allocator.blocks_for(seq.max_tokens if reserve_lifetime else cached + n) - hits.num_blocks
            if self._room_for(claimed + need, hits.blocks) and self._adapter_ready(seq):
                admitted.append(self._start(i, hits, n, scheduled))
                budget -= n
                claimed += need - (len(seq.block_table) - hits.num_blocks)
                self._overtakes = 0 if i == 0 else self._overtakes + 1
            elif i == 0 and self._overtakes >= self.config.max_overtakes:
                break
            elif reserve_lifetime:
                break  # static batches keep arrival order
            else:
                i += 1
        return admitted

    def _room_for(self, blocks: int, hits: list[int]) -> bool:
        """Whether `blocks` new blocks and the cached ones `hits` reclaims fit the pool, beside the watermark that
        admission keeps free for the running sequences."""
        watermark = self._watermark_blocks if self.running else 0
        return blocks + self.allocator.reclaimed(hits) + watermark <= self.allocator.num_free

    def _start(self, i: int, hits: CachedPrefix, n: int, scheduled: set[int]) -> ScheduledSeq:
        """Moves waiting sequence i to running on its cached prefix `hits` and schedules its first n tokens."""
        seq = self.waiting[i]
        del self.waiting[i]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._hold_adapter(seq)
        self._reuse(seq, hits)
        return self._take(seq, n, scheduled)

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether seq's LoRA adapter has (or can take) a slot now; the base model always has."""
        if not seq.lora:
            return True
        assert self.loras is not None, "requests name an adapter only with --enable-lora (the engine checks)"
        return self.loras.can_acquire(seq.lora)

    def _hold_adapter(self, seq: Sequence) -> None:
        """Gives a sequence that starts running its adapter's slot (loaded before the next pass where it is new)."""
        if seq.lora:
            assert self.loras is not None, "requests name an adapter only with --enable-lora (the engine checks)"
            seq.lora_slot = self.loras.acquire(seq.lora)

    def _continue_prompt(self, seq: Sequence, n: int, scheduled: set[int], preempted: list[int]) -> ScheduledSeq | None:
        """Schedules up to n more prompt tokens of running seq, preempting newer sequences for their blocks; None
        when no block can be had."""
        self._make_room(seq, seq.num_computed + n, scheduled, preempted, preempt_self=False)
        n = min(n, self.allocator.tokens_fitting(seq.block_table, seq.num_computed))
        return self._take(seq, n, scheduled) if n else None

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The cached blocks seq can start from. At least its last token stays to compute, for logits to sample from;
        when that token ends a block, the block is recomputed into a fresh one rather than written while shared.
        Without a window they are the longest chain of cached blocks from block 0; with one (kv_window), the blocks
        that the query after the longest such prefix can still see (BlockAllocator.lookup_window)."""
        if self.allocator.cache is None:
            return CachedPrefix()
        usable = (seq.num_tokens - 1) // self.allocator.block_size
        extend_hashes(seq.block_hashes, seq.token_ids, self.allocator.block_size, seq.cache_salt, usable)
        if self.config.kv_window is None:
            return CachedPrefix(0, self.allocator.lookup(seq.block_hashes[:usable]))
        return CachedPrefix(*self.allocator.lookup_window(seq.block_hashes[:usable], self.config.kv_window))

    def _reuse(self, seq: Sequence, hits: CachedPrefix) -> None:
        """Starts an admitted seq on its cached prefix: the blocks it shares, after the entries it skips (aliases of
        the first shared block, as release_head leaves a table)."""
        if self.allocator.cache is None:
            return
        self.allocator.share(seq.block_table, hits.blocks)
        if hits.skipped:
            assert len(seq.block_table) == len(hits.blocks) and not seq.num_released, "a waiting seq holds no blocks"
            seq.block_table[:0] = [hits.blocks[0]] * hits.skipped
            seq.num_released = hits.skipped
        seq.num_computed = hits.num_blocks * self.allocator.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = min(seq.num_computed, seq.num_prompt_tokens)
        self._prefix.queries += seq.num_tokens
        self._prefix.hits += seq.num_computed

    def _make_room(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], preempted: list[int], preempt_self: bool
    ) -> bool:
        """Gives seq the blocks to hold num_tokens, preempting newer sequences not yet in this batch to free them.
        When none is left, a decode preempts itself (preempt_self) and a prompt chunk takes what fits."""
        while self.allocator.allocate(seq.block_table, num_tokens) is None:
            victim = self.running[-1]
            if victim is seq or victim.seq_id in scheduled:
                if preempt_self:
                    self._preempt(seq, preempted)
                return False
            self._preempt(victim, preempted)
        return True

    def _preempt(self, seq: Sequence, preempted: list[int]) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.num_draft_computed = 0  # recompute prompt + generated tokens when readmitted
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        preempted.append(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        """Frees seq's blocks, dropping copies into them that no batch has carried yet (the blocks may be reused)."""
        if self._copies:
            mine = set(seq.block_table)
            self._copies = [c for c in self._copies if c[1] not in mine]
        self.allocator.free(seq.block_table, seq.num_released)
        seq.num_released = 0
        if seq.lora_slot >= 0:  # its adapter's slot may now be evicted
            assert self.loras is not None, "a slot is held only with --enable-lora"
            self.loras.release(seq.lora)
            seq.lora_slot = -1

    def _release_outside_window(self, seq: Sequence) -> None:
        """Gives back seq's blocks that its next queries cannot see: a query at position p reads keys after
        p - kv_window, and the next is at num_computed, so a block whose last key is at most num_computed - kv_window
        is read no more (nor is it by a recompute, which starts from the tokens)."""
        assert self.config.kv_window is not None
        upto = max(0, seq.num_computed - self.config.kv_window) // self.allocator.block_size
        upto = min(upto, len(seq.block_table) - 1)  # a table keeps a block for the aliases to name
        if upto > seq.num_released:
            self.allocator.release_head(seq.block_table, seq.num_released, upto)
            seq.num_released = upto

    def _take(self, seq: Sequence, n: int, scheduled: set[int]) -> ScheduledSeq:
        start = seq.num_computed
        if self.allocator.allocate(seq.block_table, start + n) is None:
            raise RuntimeError(f"KV pool exhausted while scheduling {n} tokens of sequence {seq.seq_id}")
        seq.num_computed += n
        scheduled.add(seq.seq_id)
        self._publish(seq, start)
        return ScheduledSeq(
            seq.seq_id,
            seq.token_ids[start : start + n],
            start,
            list(seq.block_table),
            start + n == seq.num_tokens,
            lora_slot=seq.lora_slot,
        )

    def _publish(self, seq: Sequence, start: int) -> None:
        """Registers the blocks that the tokens from `start` on fill, for later sequences to share."""
        if self.allocator.cache is None:
            return
        bs = self.allocator.block_size
        first, end = start // bs, seq.num_computed // bs
        if first < end:
            extend_hashes(seq.block_hashes, seq.token_ids, bs, seq.cache_salt, end)
            for i in range(first, end):
                self.allocator.publish(seq.block_table[i], seq.block_hashes[i])
