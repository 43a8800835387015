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
    """(flat KV slots the mask may touch, boolean mask over them per query row)."""
    kv_indices = block_mask.kv_indices
    listed = torch.arange(kv_indices.shape[-1], device=kv_indices.device) < block_mask.kv_num_blocks[..., None]
    pages = kv_indices[listed].unique().long()
    page_size = block_mask.BLOCK_SIZE[1]
    slots = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).flatten()
    if decode:
        rows = torch.arange(kv_indices.shape[0], device=slots.device)[:, None]
        mask = block_mask.mask_mod(rows, 0, 0, slots[None, :])
    else:
        rows = torch.arange(block_mask.seq_lengths[0], device=slots.device)[:, None]
        mask = block_mask.mask_mod(0, 0, rows, slots[None, :])
    return slots, mask


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D). mask: (T, S') over the gathered `slots`."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = k_cache[0][:, slots].float()                       # (Hkv, S', D)
    v = v_cache[0][:, slots].float()
    q5 = q.float().view(tokens, num_kv_heads, group, head_dim)
    scores = torch.einsum("thgd,hsd->thgs", q5, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("thgs,hsd->thgd", scores.softmax(dim=-1), v)
    return out.reshape(tokens, num_heads, head_dim).to(q.dtype)
