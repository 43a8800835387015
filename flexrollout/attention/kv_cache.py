"""Paged KV cache tensors: one (1, kv_heads, num_pages * page_size, head_dim) pair per layer.

Flat slot `s` lives on page `s // page_size`. Page 0 is the padding page: padded graph rows and
padded prefill tokens write there and attend only there, so padding never touches real data.
"""
from __future__ import annotations

import torch

from ..models.base import LayerSpec


class KVCache:
    def __init__(self, layers: list[LayerSpec], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layers = layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        num_slots = self.num_pages * self.page_size
        self.k, self.v = [], []
        for spec in self.layers:
            if spec.kv_source is not None:
                # KV-sharing layers read an earlier layer's cache and never write.
                self.k.append(self.k[spec.kv_source])
                self.v.append(self.v[spec.kv_source])
                continue
            shape = (1, spec.num_kv_heads, num_slots, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def release(self) -> None:
        """Drop the cache tensors (sleep); `allocate` makes new, empty ones."""
        self.k, self.v = [], []

    @staticmethod
    def bytes_per_page(layers: list[LayerSpec], page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = sum(2 * s.num_kv_heads * s.head_dim for s in layers if s.kv_source is None)
        return per_token * page_size * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V of shape (tokens, kv_heads, head_dim) at flat slots (tokens,)."""
        self.k[layer][0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(self.k[layer].dtype))
        self.v[layer][0].index_copy_(1, slot_mapping, v.transpose(0, 1).to(self.v[layer].dtype))

    def copy_pages(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Copy whole pages in every layer (copy-on-write of a shared, partly filled page)."""
        offsets = torch.arange(self.page_size, device=src_pages.device)
        src = (src_pages[:, None] * self.page_size + offsets).flatten()
        dst = (dst_pages[:, None] * self.page_size + offsets).flatten()
        seen: set[int] = set()
        for k, v in zip(self.k, self.v):
            if id(k) in seen:
                continue
            seen.add(id(k))
            k[0].index_copy_(1, dst, k[0].index_select(1, src))
            v[0].index_copy_(1, dst, v[0].index_select(1, src))
