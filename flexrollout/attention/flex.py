"""flex_attention over the paged cache, for packed prefill and for decode.

Decode folds each KV head's GQA group into the query-length axis: q (B, Hq, D) becomes
(B, Hkv, G, D) attending a single KV head. Every group size works that way (SmolLM2 has 3),
and flex's fused decode kernel sees no GQA at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .reference import dense_view, reference_attention

_compiled: dict[bool, object] = {}


# Two code objects, so the static (decode) and dynamic (prefill) compilations keep separate caches.
def _flex_decode(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _flex_prefill(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _flex(device: torch.device, decode: bool):
    """The fused (compiled) kernels on CUDA; flex's unfused reference elsewhere.

    Decode compiles with static shapes, one specialisation per graph bucket, because flex picks
    its fused decode kernel only for a static batch. Prefill shapes vary with packing: dynamic.
    """
    if device.type != "cuda":
        return flex_attention
    if decode not in _compiled:
        # One decode specialisation per batch bucket must not hit dynamo's recompile limit.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 512)
        wrapper = _flex_decode if decode else _flex_prefill
        _compiled[decode] = torch.compile(wrapper, fullgraph=True, dynamic=not decode)
    return _compiled[decode]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward; built by the runner, read by every layer."""

    positions: torch.Tensor          # (T,) position of each token
    slot_mapping: torch.Tensor       # (T,) flat KV slot each token's K/V is written to
    decode: bool                     # one token per sequence (True) or packed prefill (False)
    block_masks: dict[int | None, BlockMask]   # keyed by sliding window (None = full attention)
    kernel_options: dict[str, Any] = field(default_factory=dict)
    # "flex" (fused kernels; CUDA) or "reference" (dense mask_mod evaluation; CPU).
    backend: str = "flex"
    # Per-row LoRA adapters of this step (a `LoraBatch`), or None. It rides along with the
    # attention metadata so forward functions keep one small signature.
    lora: Any = None
    _dense: dict = field(default_factory=dict, repr=False)

    def dense(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered slots and mask for the reference backend, built once per step per window."""
        if window not in self._dense:
            self._dense[window] = dense_view(self.block_masks[window], self.decode)
        return self._dense[window]


def decode_kernel_options(opts: dict | None, batch: int, num_kv_heads: int, max_pages: int,
                          device: torch.device) -> dict:
    """flex decode's options, where the caller's (EngineConfig.flex_kernel_options) leave them.

    SPLIT_KV is capped at the pages one sequence can hold: flex splits each row's KV into
    SPLIT_KV tiles, by default 2 x SMs / (batch x kv heads) whatever the context, 32 at batch 1
    on an H200. Each tile is a whole number of BLOCK_N keys of the row's own pages, so splits
    beyond its page count run empty and still cost a launch slot and a share of the reduction
    (0.5 ms of a 3.7 ms Qwen3-4B step at batch 1).

    num_stages: flex's default on an H200 is one (no prefetch of the next KV block). Three cut
    a Qwen3-4B layer's decode attention at context 256 from 7.5 to 6.8 us at batch 1 and from
    16.1 to 13.6 us at batch 8; at batch 64, where the split is already 1, two are best
    (25.8 -> 25.0 us). Measured with benchmarks/attention_sweep.py on an H200.
    """
    opts = dict(opts or {})
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(batch * num_kv_heads, 1)
    if "SPLIT_KV" not in opts:
        opts["SPLIT_KV"] = max(1, min(sms // programs * 2, max_pages))
    opts.setdefault("num_stages", 3 if programs <= 2 * sms else 2)
    return opts


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq * D), attending the cache through the metadata's block mask."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if meta.backend == "reference":
        slots, mask = meta.dense(window)
        out = reference_attention(q, k_cache, v_cache, slots, mask, scale)
        return out.reshape(tokens, num_heads * head_dim)
    block_mask = meta.block_masks[window]
    flex = _flex(q.device, meta.decode)
    opts = meta.kernel_options or None
    if meta.decode:
        group = num_heads // num_kv_heads
        q4 = q.view(tokens, num_kv_heads, group, head_dim)
        if q.is_cuda:
            opts = decode_kernel_options(opts, tokens, num_kv_heads, block_mask.kv_indices.shape[-1],
                                         q.device)
        out = flex(q4, k_cache, v_cache, block_mask=block_mask, scale=scale, kernel_options=opts)
    else:
        # A packed prefill shorter than 128 tokens would otherwise be routed to flex's decode
        # kernel, whose BLOCK_M (next power of two of tokens x GQA group) can exceed the 128-row
        # query block, leaving inductor no valid config (NoValidChoicesError, seen on the H200).
        # (EngineConfig.flex_kernel_options are tuned for the decode kernel and not passed here.)
        opts = {"FORCE_USE_FLEX_ATTENTION": True}
        q4 = q.transpose(0, 1).unsqueeze(0)
        out = flex(q4, k_cache, v_cache, block_mask=block_mask, scale=scale,
                   enable_gqa=num_heads != num_kv_heads, kernel_options=opts)
        out = out.squeeze(0).transpose(0, 1)
    return out.reshape(tokens, num_heads * head_dim)
