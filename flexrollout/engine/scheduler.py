"""Continuous batching: admit waiting groups while slots and pages allow, decode the rest.

A group is the samples of one prompt (n > 1, or identical prompts in one call): its leader is
prefilled once and the other members fork from it. Prefill comes first; prompt pages are
allocated at admission so a chunked prefill never waits for pages. Decode grows pages one at a
time and, when none are left, preempts the most recently admitted sequence (recompute later).
A request that could not fit alone is rejected before any work (see `LLMEngine`), so the
oldest running sequence can always make progress: no deadlock.

With async decode a sequence may hold a pending token (sampled on the device, not yet read
back): decode counts it (pages, length limit), and `prefill_ready` / `decode_fits` let the
engine ask, without changing anything, whether the next step needs the exact host state.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .page_table import PageTable
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    prefill: list[tuple[Sequence, int]]      # (leader, tokens to compute this step)
    decode: list[Sequence]


class Scheduler:
    def __init__(self, pages: PageTable, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.pages = pages
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []    # in admission order
        self.num_preemptions = 0

    def add_group(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        prefill = self._schedule_prefill()
        if prefill:
            return ScheduledBatch(prefill, [])
        return ScheduledBatch([], self._schedule_decode())

    # -- questions asked before scheduling (they change nothing) -------------------------------
    def prefill_ready(self) -> bool:
        """The next `schedule` would return a prefill step."""
        return any(s.share_with is None and s.in_prefill for s in self.running) or (
            bool(self.waiting) and self._can_admit(self.waiting[0]))

    def admission_after_drain(self) -> bool:
        """A group waits and a running sequence ends with its pending token (max_tokens): the
        synchronous loop would free its slot first and admit, so the engine should drain."""
        return bool(self.waiting) and any(s.length_exhausted for s in self.running)

    def decode_candidates(self) -> list[Sequence]:
        """Sequences the next decode step would take if nothing had to be preempted."""
        return [s for s in self.running if s.share_with is None and not s.length_exhausted]

    def decode_fits(self) -> bool:
        """The next decode step finds every page it needs without preempting."""
        needed = sum(self.pages.pages_needed(s.slot, s.num_tokens_with_pending)
                     for s in self.decode_candidates())
        return needed <= self.pages.num_free_pages

    # -- prefill -----------------------------------------------------------------------------
    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batched_tokens
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.share_with is None and seq.in_prefill and budget > 0:
                count = min(seq.num_tokens - seq.num_computed, budget)
                chunks.append((seq, count))
                budget -= count
        while self.waiting and budget > 0 and self._can_admit(self.waiting[0]):
            group = self.waiting.popleft()
            self._admit(group)
            leader = group[0]
            count = min(leader.num_tokens, budget)
            chunks.append((leader, count))
            budget -= count
        return chunks

    def _group_pages(self, group: list[Sequence]) -> int:
        leader = group[0]
        partial = leader.num_tokens % self.pages.page_size != 0
        return self.pages.pages_for(leader.num_tokens) + (len(group) - 1) * int(partial)

    def _can_admit(self, group: list[Sequence]) -> bool:
        if len(self.running) + len(group) > self.max_num_seqs or self.pages.num_free_slots < len(group):
            return False
        # Keep a page per running sequence in reserve so admission does not force preemption.
        reserve = len(self.running)
        return self.pages.num_free_pages >= self._group_pages(group) + reserve

    def _admit(self, group: list[Sequence]) -> None:
        leader = group[0]
        for seq in group:
            seq.slot = self.pages.acquire_slot()
            seq.status = Status.RUNNING
            seq.num_computed = 0
            seq.share_with = leader if seq is not leader else None
            self.running.append(seq)
        self.pages.grow(leader.slot, leader.num_tokens)

    # -- decode ------------------------------------------------------------------------------
    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.share_with is not None:
                continue                      # preempted earlier in this loop, or not forked yet
            if seq.length_exhausted:
                continue                      # its pending token ends it: never compute past it
            length = seq.num_tokens_with_pending
            while self.pages.pages_needed(seq.slot, length) > self.pages.num_free_pages:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.pages.grow(seq.slot, length)
                batch.append(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it is recomputed from its tokens when readmitted."""
        if seq.num_pending:
            raise RuntimeError("preempting a sequence whose pending token was not read back")
        self.running.remove(seq)
        self.pages.release_slot(seq.slot)
        seq.slot, seq.num_computed, seq.share_with = 0, 0, None
        seq.status = Status.WAITING
        self.waiting.appendleft([seq])
        self.num_preemptions += 1

    def abort_all(self) -> None:
        """Drop every sequence (a step failed): free their slots and pages."""
        for seq in list(self.running):
            self.pages.release_slot(seq.slot)
            seq.slot, seq.status, seq.num_pending = 0, Status.FINISHED, 0
        self.running.clear()
        self.waiting.clear()

    def finish(self, seq: Sequence) -> None:
        """Free a finished sequence's slot and pages. A step still in flight may use them: it was
        launched before this call, so stream order keeps any later reuse behind it."""
        self.running.remove(seq)
        self.pages.release_slot(seq.slot)
        seq.slot = 0
        seq.status = Status.FINISHED
        seq.num_pending = 0         # a token computed past the stop is discarded, not read
