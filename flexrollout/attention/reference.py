"""Dense reference attention over the paged cache, for CPU.

flex_attention without torch.compile evaluates its mask_mod through four nested vmaps on every
call and for every KV slot in the cache, which makes CPU generation crawl. This path evaluates
the *same* mask_mod once per step with plain broadcasting, over only the pages the block mask
lists, and runs fp32 softmax attention on that gathered KV. Masks, page tables and metadata are
shared with the flex path; only the kernel differs.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask


def dense_view(block_mask: BlockMask, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat KV slots the mask may touch, boolean mask over them per query row).

    Decode gathers each row's own pages: slots (B, L), linear in the batch. Prefill gathers the
    union of the pages its query blocks list: slots (S',), shared by every query row.
    """
    kv_indices = block_mask.kv_indices
    page_size = block_mask.BLOCK_SIZE[1]
    offsets = torch.arange(page_size, device=kv_indices.device)
    if decode:
        pages, listed = _row_pages(kv_indices, block_mask.kv_num_blocks)
        if block_mask.full_kv_indices is not None:
            full, full_listed = _row_pages(block_mask.full_kv_indices, block_mask.full_kv_num_blocks)
            pages, listed = torch.cat([pages, full], dim=1), torch.cat([listed, full_listed], dim=1)
        slots = (pages[..., None] * page_size + offsets).flatten(1)
        rows = torch.arange(pages.shape[0], device=slots.device)[:, None]
        mask = block_mask.mask_mod(rows, 0, 0, slots) & listed.repeat_interleave(page_size, dim=1)
        return slots, mask
    listed = torch.arange(kv_indices.shape[-1], device=kv_indices.device) < block_mask.kv_num_blocks[..., None]
    pages = kv_indices[listed].unique().long()
    slots = (pages[:, None] * page_size + offsets).flatten()
    rows = torch.arange(block_mask.seq_lengths[0], device=slots.device)[:, None]
    return slots, block_mask.mask_mod(0, 0, rows, slots[None, :])


def _row_pages(kv_indices: torch.Tensor, kv_num_blocks: torch.Tensor):
    """Decode rows' listed pages (B, N) and which of them count (B, N), N = the longest list."""
    width = max(int(kv_num_blocks.max()), 1)             # CPU path: a host read is free
    pages = kv_indices[:, 0, 0, :width].long()
    return pages, torch.arange(width, device=pages.device) < kv_num_blocks[:, 0, 0, None]


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, mask: torch.Tensor, scale: float,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D). slots: (S',) shared by all rows or (T, L) per row;
    mask: (T, S') or (T, L) over them; sinks: (Hq,) extra softmax logits without a value."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = _gather(k_cache, slots)                            # (Hkv, S', D) or (Hkv, T, L, D)
    v = _gather(v_cache, slots)
    q5 = q.float().view(tokens, num_kv_heads, group, head_dim)
    per_row = slots.dim() == 2
    if per_row and sinks is None:
        # Decode: one fused SDPA call, the GQA group as the query length of each KV head. On a
        # CPU every separate op is a thread-pool round trip, which dominates at these sizes.
        out = torch.nn.functional.scaled_dot_product_attention(
            q5, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(tokens, num_heads, head_dim).to(q.dtype)
    scores = torch.einsum("thgd,htsd->thgs" if per_row else "thgd,hsd->thgs", q5, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is None:
        weights = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(tokens, -1, -1, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("thgs,htsd->thgd" if per_row else "thgs,hsd->thgd", weights, v)
    return out.reshape(tokens, num_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[0][:, slots] in fp32. index_select, not advanced indexing: on CPU the latter's
    kernel cost milliseconds per call at decode sizes (measured: 4-8 ms against 10-20 us)."""
    flat = cache[0].index_select(1, slots.reshape(-1))
    return flat.view(cache.shape[1], *slots.shape, cache.shape[-1]).float()
