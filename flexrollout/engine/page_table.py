"""The one owner of KV paging: free pages, reference counts, batch slots and the page table.

Host lists are the truth; the device tensors mirror them and are updated in one batch per step
(`flush`), so the decode hot path never reads anything back from the device.

Page 0 and slot 0 are reserved: padded rows use slot 0, whose table row is all page 0.
"""
from __future__ import annotations

import torch


class PageTable:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_pages_per_seq: int,
                 device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.max_pages_per_seq = max_pages_per_seq
        self.table = torch.zeros(max_slots + 1, max_pages_per_seq, dtype=torch.int32, device=device)
        self.page_logical = torch.zeros(num_pages, dtype=torch.int32, device=device)
        self.pages_allocated = 0                               # cumulative, for stats and tests
        self.reset()

    def reset(self) -> None:
        """Everything free. Device rows need no clearing: stale entries sit beyond every
        sequence's length, where the causal check hides them (see attention/masks.py)."""
        self.free_pages = list(range(self.num_pages - 1, 0, -1))   # pop() hands out low pages first
        self.free_slots = list(range(self.max_slots, 0, -1))
        self.refcount = [0] * self.num_pages
        self.pages: dict[int, list[int]] = {}                  # slot -> its pages, in logical order
        self._pending: list[tuple[int, int, int]] = []         # (slot, logical index, page)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def acquire_slot(self) -> int:
        slot = self.free_slots.pop()
        self.pages[slot] = []
        return slot

    def release_slot(self, slot: int) -> None:
        """Drop the slot and every page it references (pages shared with others survive)."""
        # Unflushed table writes of this slot must not land on the slot's next owner.
        self._pending = [entry for entry in self._pending if entry[0] != slot]
        for page in self.pages.pop(slot):
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.free_pages.append(page)
        self.free_slots.append(slot)

    def pages_needed(self, slot: int, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(self.pages[slot]))

    def grow(self, slot: int, num_tokens: int) -> None:
        """Make the slot hold `num_tokens` tokens; the caller has checked the free count."""
        pages = self.pages[slot]
        while len(pages) < self.pages_for(num_tokens):
            page = self.free_pages.pop()
            self.refcount[page] = 1
            self._set(slot, len(pages), page)
            pages.append(page)
            self.pages_allocated += 1

    def share(self, src_slot: int, dst_slot: int, num_pages: int) -> None:
        """Let dst reference src's first `num_pages` pages (a shared prompt prefix)."""
        for logical, page in enumerate(self.pages[src_slot][:num_pages]):
            self.refcount[page] += 1
            self._set(dst_slot, logical, page)
            self.pages[dst_slot].append(page)

    def fork(self, src_slot: int, dst_slot: int, num_tokens: int) -> tuple[int, int] | None:
        """Give dst the first `num_tokens` tokens of src: full pages by reference, the partly
        filled last page as a fresh copy (copy-on-write). Returns (src_page, dst_page) to copy."""
        full = num_tokens // self.page_size
        self.share(src_slot, dst_slot, full)
        if num_tokens % self.page_size == 0:
            return None
        self.grow(dst_slot, num_tokens)
        return self.pages[src_slot][full], self.pages[dst_slot][full]

    def _set(self, slot: int, logical: int, page: int) -> None:
        self._pending.append((slot, logical, page))

    def flush(self) -> None:
        """Apply this step's page-table changes to the device mirror in one transfer."""
        if not self._pending:
            return
        changes = torch.tensor(list(zip(*self._pending)), dtype=torch.long)   # (3, n)
        device = self.table.device
        if device.type == "cuda":
            # Pinned + non_blocking: the copy queues behind the running step instead of waiting
            # for it (the host allocator keeps the pinned buffer until the copy is done).
            changes = changes.pin_memory().to(device, non_blocking=True)
        slots, logicals, pages = changes
        self.table.index_put_((slots, logicals), pages.to(torch.int32))
        self.page_logical.index_put_((pages,), logicals.to(torch.int32))
        self._pending.clear()
