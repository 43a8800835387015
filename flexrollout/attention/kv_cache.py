"""The cache manager: every layer's KV storage, its layout, and the writes into it.

Layout: one (1, kv_heads, num_pages * page_size, head_dim) tensor for K and one for V per layer
that owns KV. Flat slot `s` lives on page `s // page_size`; page 0 is the padding page (padded
graph rows and padded prefill tokens write there and attend only there). A layer that reads an
earlier layer's KV (`LayerSpec.kv_source`) is handed that layer's tensors and never writes; a
linear-attention layer has no KV at all. `store_kv` is the one place K/V are written (the q/k/v
epilogue kernel reads the layout from the tensors' strides).

Per-sequence states (`LayerSpec.states`, a linear-attention layer's conv and recurrent state) live
in pools of one entry per batch slot, slot 0 the padding slot that padded graph rows write. The
layer writes them in place; a forked group member gets a copy of its leader's (`copy_states`).
"""
from __future__ import annotations

import torch

from ..spec import LayerSpec


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write K/V of shape (tokens, kv_heads, head_dim) at flat slots (tokens,).

    An `index_copy_` on the whole 4-D tensor: inside a compiled region a write through a view of
    the cache made inductor copy the whole cache."""
    k_cache.index_copy_(2, slot_mapping, k.transpose(0, 1)[None].to(k_cache.dtype))
    v_cache.index_copy_(2, slot_mapping, v.transpose(0, 1)[None].to(v_cache.dtype))


class KVCache:
    def __init__(self, layers: list[LayerSpec], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, num_slots: int = 0) -> None:
        self.layers = layers
        self.num_slots = num_slots          # batch slots, the padding slot 0 included
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        # Per layer: state name -> (num_slots, *StateSpec.shape) pool; empty for attention layers.
        self.states: list[dict[str, torch.Tensor]] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        num_slots = self.num_pages * self.page_size
        self.k, self.v = [], []
        for spec in self.layers:
            if spec.kv_source is not None:
                self.k.append(self.k[spec.kv_source])
                self.v.append(self.v[spec.kv_source])
            elif spec.owns_kv:
                shape = (1, spec.num_kv_heads, num_slots, spec.head_dim)
                self.k.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                self.v.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            else:
                self.k.append(None)
                self.v.append(None)
        self.states = [{s.name: torch.zeros((self.num_slots, *s.shape), dtype=s.dtype, device=self.device)
                        for s in spec.states} for spec in self.layers]

    def release(self) -> None:
        """Drop the cache tensors (sleep); `allocate` makes new, empty ones."""
        self.k, self.v, self.states = [], [], []

    @staticmethod
    def state_bytes(layers: list[LayerSpec], num_slots: int) -> int:
        """Bytes of every per-sequence state pool."""
        per_slot = sum(torch.Size(s.shape).numel() * torch.empty((), dtype=s.dtype).element_size()
                       for spec in layers for s in spec.states)
        return per_slot * num_slots

    def copy_states(self, src_slot: int, dst_slot: int) -> None:
        """Give `dst_slot` a copy of every per-sequence state of `src_slot` (a group fork)."""
        for pools in self.states:
            for pool in pools.values():
                pool[dst_slot].copy_(pool[src_slot])

    @staticmethod
    def bytes_per_token(layers: list[LayerSpec], dtype: torch.dtype) -> int:
        """KV bytes one token occupies: layers that read another layer's KV add nothing."""
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * s.num_kv_heads * s.head_dim for s in layers if s.owns_kv) * elem

    @staticmethod
    def max_pages(layers: list[LayerSpec], page_size: int) -> int:
        """The most pages (padding page included) that keep every K/V tensor under 2^31 elements.

        Past that, Inductor indexes flex decode in int64, and torch 2.11's decode template then
        fails to compile (a ternary of int64 and int32 block counts; seen on the H200 with
        Qwen3.5-4B's 3.3M-token default cache). Our Triton kernels index in int32 too."""
        widest = max((s.num_kv_heads * s.head_dim for s in layers if s.owns_kv), default=1)
        return (2**31 - 1) // (widest * page_size)

    @staticmethod
    def bytes_per_page(layers: list[LayerSpec], page_size: int, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(layers, dtype) * page_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store a layer's K/V (tokens, kv_heads, head_dim) at flat slots (tokens,)."""
        store_kv(self.k[layer], self.v[layer], k, v, slot_mapping)

    def owned(self):
        """(K, V) of every layer that owns its KV, each pair once."""
        return [(k, v) for spec, k, v in zip(self.layers, self.k, self.v) if spec.owns_kv]

    def copy_pages(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Copy whole pages in every layer (copy-on-write of a shared, partly filled page)."""
        offsets = torch.arange(self.page_size, device=src_pages.device)
        src = (src_pages[:, None] * self.page_size + offsets).flatten()
        dst = (dst_pages[:, None] * self.page_size + offsets).flatten()
        for k, v in self.owned():
            k[0].index_copy_(1, dst, k[0].index_select(1, src))
            v[0].index_copy_(1, dst, v[0].index_select(1, src))
