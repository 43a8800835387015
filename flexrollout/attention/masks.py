"""Block masks built straight from the page table.

Both masks attend over the whole paged cache (KV length = num_pages * page_size). The sparse
block lists name exactly the pages a query may touch, so the fused kernels visit
O(pages per sequence), and the mask_mod is exact on its own (the eager path evaluates it
everywhere): a KV slot is visible when its page belongs to the query's sequence at the
logical index `page_logical[page]` and its logical position is causal (and inside the window).

`page_logical[p]` is the logical page index of physical page p. It is one number per page even
with prefix sharing, because a shared page sits at the same logical index in every sharer.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

Q_BLOCK = 128


def _paged_mask_mod(page_of, position_of, page_logical: torch.Tensor, page_size: int,
                    window: int | None):
    """The mask_mod of both masks: KV slot `kv_idx` is visible to a query when its page is the
    query's sequence's page at the slot's logical index, and its logical position is causal (and
    inside the window). `page_of(b, q_idx, logical_page)` and `position_of(b, q_idx)` say where
    the query's page-table row and position come from."""
    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // page_size
        lp = page_logical[page]
        logical = lp * page_size + kv_idx % page_size
        q_pos = position_of(b, q_idx)
        ok = (page_of(b, q_idx, lp) == page) & (logical <= q_pos)
        if window is not None:
            ok = ok & (logical > q_pos - window)
        return ok

    return mask_mod


def decode_block_mask(rows: torch.Tensor, num_pages: torch.Tensor, q_pos: torch.Tensor,
                      page_logical: torch.Tensor, page_size: int, q_len: int, kv_len: int,
                      window: int | None = None, full_blocks: bool = False) -> BlockMask:
    """One query position per batch row b (q_len > 1 only when GQA groups are folded into it).

    rows: (B, max_pages) page table rows of the batch; num_pages: (B,) pages in use;
    q_pos: (B,) position of the token being decoded.

    Every listed page is a partial block (mask_mod evaluated), though all but a row's last are
    wholly visible. flex cuts partial blocks into even KV splits of the listed pages, but full
    blocks into splits of the cache's whole length, so in an engine-sized cache one program
    reads all of a row's full pages. `full_blocks=True` (kept for benchmarks/attention_sweep.py)
    lists them as full blocks; at a 2,048-token context, 4,096-page cache, H100, 2026-12-06, per
    layer: Qwen3-4B's heads 35 / 40 / 183 us against 12 / 35 / 185 all partial at batch 1 / 8 /
    64; Gemma-4's one 512-wide KV head 2,783 / 3,120 / 3,407 us against 15 / 26 / 113.
    With a window, only the pages the window reaches are listed (at most ceil(W / page) + 1), so
    a sliding layer's decode reads O(window), not O(context). mask_mod stays exact everywhere:
    the reference backend evaluates it on both lists.
    """
    mask_mod = _paged_mask_mod(lambda b, q, lp: rows[b, lp], lambda b, q: q_pos[b],
                               page_logical, page_size, window)
    num_pages = num_pages.to(torch.int32)
    if window is not None:
        span = min(rows.shape[1], -(-window // page_size) + 1)
        first = ((q_pos - window + 1).clamp(min=0) // page_size).to(torch.int32)
        offsets = torch.arange(span, device=rows.device, dtype=torch.int32)
        listed = rows.gather(1, (first[:, None] + offsets).clamp(max=rows.shape[1] - 1).long())
        return BlockMask.from_kv_blocks(
            (num_pages - first)[:, None, None], listed[:, None, None, :], BLOCK_SIZE=(Q_BLOCK, page_size),
            mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)
    if not full_blocks:      # the engine's
        return BlockMask.from_kv_blocks(
            num_pages[:, None, None], rows[:, None, None, :], BLOCK_SIZE=(Q_BLOCK, page_size),
            mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)
    last = rows.gather(1, (num_pages.long() - 1)[:, None])
    partial = torch.cat([last, rows[:, 1:]], dim=1)
    return BlockMask.from_kv_blocks(
        torch.ones_like(num_pages)[:, None, None], partial[:, None, None, :],
        full_kv_num_blocks=(num_pages - 1)[:, None, None], full_kv_indices=rows[:, None, None, :],
        BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
        compute_q_blocks=False)


def prefill_block_mask(table: torch.Tensor, q_slot: torch.Tensor, q_pos: torch.Tensor,
                       page_logical: torch.Tensor, page_size: int, kv_len: int,
                       kv_indices: torch.Tensor, kv_num_blocks: torch.Tensor,
                       window: int | None = None) -> BlockMask:
    """Packed prefill: query token t belongs to batch slot q_slot[t] at position q_pos[t].

    table: (slots, max_pages) device page table; kv_indices (q_blocks, n) / kv_num_blocks
    (q_blocks,) list the pages each 128-token query block may touch (see `prefill_page_lists`).
    """
    mask_mod = _paged_mask_mod(lambda b, q, lp: table[q_slot[q], lp], lambda b, q: q_pos[q],
                               page_logical, page_size, window)
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None].to(torch.int32), kv_indices[None, None].to(torch.int32),
        BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=mask_mod,
        seq_lengths=(q_slot.numel(), kv_len), compute_q_blocks=False)


def prefill_page_lists(chunks: list[tuple[list[int], int, int]], num_tokens: int, page_size: int,
                       window: int | None = None) -> tuple[list[list[int]], int]:
    """Pages each query block of a packed prefill may touch, computed on the host.

    chunks: per packed sequence (its pages, first position, number of tokens), in packing order.
    Returns one page list per 128-token query block and the longest list's length.
    """
    num_blocks = -(-num_tokens // Q_BLOCK)
    per_block: list[dict[int, None]] = [dict() for _ in range(num_blocks)]
    start = 0
    for pages, first_pos, count in chunks:
        for blk in range(start // Q_BLOCK, (start + count - 1) // Q_BLOCK + 1):
            lo_tok = max(start, blk * Q_BLOCK) - start
            hi_tok = min(start + count, (blk + 1) * Q_BLOCK) - 1 - start
            last_page = (first_pos + hi_tok) // page_size
            first_page = 0 if window is None else max(0, (first_pos + lo_tok - window + 1) // page_size)
            per_block[blk].update(dict.fromkeys(pages[first_page:last_page + 1]))
        start += count
    lists = [list(d) for d in per_block]
    return lists, max((len(x) for x in lists), default=0)
