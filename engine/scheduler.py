"""Who runs this step, and how many tokens each (vLLM V1 policy).

There is no prefill phase nor decode phase: a request has `num_tokens` known and
`num_computed_tokens` in the KV cache, and each step closes part of that gap under one token
budget. Running decodes go first (one token each), then unfinished prefill chunks, then new
requests from the waiting queue; a per-request cap keeps one long prompt from taking the whole
step. When blocks run out, the newest running request is preempted by recompute: its blocks are
freed and it goes back to the front of the waiting queue.

With chunked prefill off the scheduler follows vLLM V0: waiting prompts are prefilled whole, in
steps of their own, before the running decodes get another token.
"""

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.finish_reason import FinishReason
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    num_prefill_tokens: int = 0  # tokens of requests not decoding (prompt or recompute)
    num_decode_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
        if seq.is_decoding:
            self.num_decode_tokens += num_tokens
        else:
            self.num_prefill_tokens += num_tokens

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- hand-offs between processes (disaggregated mode) -----------------------------------

    def detach(self, seq: Sequence) -> None:
        """Take a running request out with its blocks still allocated: its KV moves on to
        another process, and whoever holds it frees the blocks (BlockManager.free_seq)."""
        self.running.remove(seq)

    def adopt(self, seq: Sequence) -> None:
        """A request whose KV is already in its blocks joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def start_decoding(self, seq: Sequence) -> None:
        """A waiting request whose prefill ran elsewhere counts as running from now on (the
        disaggregated front, which holds no blocks of its own)."""
        self.waiting.remove(seq)
        self.adopt(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        chunked = self.config.enable_chunked_prefill
        if not chunked and self.waiting:
            self._admit_waiting(batch, max(self.config.max_num_batched_tokens,
                                           self.config.max_model_len))
            if batch:
                return batch  # a prefill-only step
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        for seq in [s for s in self.running if s.is_decoding]:
            if budget == 0:
                break
            # A request preempted earlier in this loop is skipped.
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1, batch):
                batch.add(seq, 1)
                budget -= 1
        cap = self.config.prefill_chunk_cap
        for seq in [s for s in self.running if not s.is_decoding]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, cap, budget)
            num_tokens = self._fit_chunk(seq, num_tokens, batch)
            if num_tokens:
                batch.add(seq, num_tokens)
                budget -= num_tokens
        if chunked and self.num_preemptions == preemptions_before and budget > 0:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        cap = self.config.prefill_chunk_cap
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.match_prefix(seq)
            num_tokens = seq.num_tokens - len(hits) * bm.block_size
            if chunked:
                num_tokens = min(num_tokens, cap, budget)
            elif num_tokens > budget:
                break
            if not bm.can_allocate(seq, num_tokens, hits):
                break
            bm.allocate(seq, num_tokens, hits)
            bm.record_prefix_lookup(seq.num_tokens, len(hits))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_tokens)
            budget -= num_tokens

    def _reserve(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Blocks for a decode token, preempting newer requests not yet in this step's batch
        until they fit; False when `seq` itself had to go."""
        bm = self.block_manager
        while not bm.can_allocate(seq, num_tokens):
            victim = self._newest_unscheduled(batch)
            self.preempt(victim)
            if victim is seq:
                return False
        bm.allocate(seq, num_tokens)
        return True

    def _fit_chunk(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> int:
        """Blocks for a prefill chunk: preempt newer unscheduled requests, else shrink the
        chunk to the free blocks. A chunk shrinks to nothing only while every newer request
        is in this step's batch, and those requests progress and free blocks in turn."""
        bm = self.block_manager
        while not bm.can_allocate(seq, num_tokens):
            victim = self._newest_unscheduled(batch)
            if victim is seq:
                room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size
                num_tokens = max(0, room - seq.num_computed_tokens)
                break
            self.preempt(victim)
        if num_tokens:
            bm.allocate(seq, num_tokens)
        return num_tokens

    def _newest_unscheduled(self, batch: ScheduledBatch) -> Sequence:
        scheduled = batch.seqs
        for seq in reversed(self.running):
            if seq not in scheduled:
                return seq
        raise AssertionError("the request being scheduled is always unscheduled")

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.timeline.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch) -> None:
        """Account for a finished forward pass: the scheduled tokens are now in the cache."""
        bm = self.block_manager
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a request (stopped, out of tokens, or aborted) and free its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
