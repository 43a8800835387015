"""flex_attention over the paged cache, for packed prefill and for decode.

Decode folds each KV head's GQA group into the query-length axis: q (B, Hq, D) becomes
(B, Hkv, G, D) attending a single KV head. Every group size works that way (SmolLM2 has 3),
and flex's fused decode kernel sees no GQA at all.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..compile import compiled, deepest_fitting
from ..spec import LayerSpec
from .reference import dense_view, reference_attention

# Decode kernels Inductor could not fit in shared memory at the stages asked, by (GQA group,
# head_dim, dtype, stages asked): the stages they compiled with (`_decode_fitting`).
_FITTED_STAGES: dict[tuple, int] = {}


# Two code objects, so the static (decode) and dynamic (prefill) compilations keep separate caches.
def _flex_decode(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _flex_prefill(*args, **kwargs):
    return flex_attention(*args, **kwargs)


@functools.cache
def _flex_compiled(decode: bool):
    """Decode compiles with static shapes, one specialisation per graph bucket, because flex
    picks its fused decode kernel only for a static batch. Prefill shapes vary with packing."""
    return compiled(_flex_decode if decode else _flex_prefill, fullgraph=True, dynamic=not decode)


def _flex(device: torch.device, decode: bool):
    """The fused (compiled) kernels on CUDA; flex's unfused reference elsewhere."""
    return _flex_compiled(decode) if device.type == "cuda" else flex_attention


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward; built by the runner, read by every layer."""

    positions: torch.Tensor          # (T,) position of each token
    slot_mapping: torch.Tensor       # (T,) flat KV slot each token's K/V is written to
    decode: bool                     # one token per sequence (True) or packed prefill (False)
    # Decode: keyed by LayerSpec.mask_key (window, GQA group); prefill: keyed by window.
    block_masks: dict[Any, BlockMask]
    kernel_options: dict[str, Any] = field(default_factory=dict)
    # "flex" (fused kernels; CUDA) or "reference" (dense mask_mod evaluation; CPU).
    backend: str = "flex"
    # Per-row LoRA adapters of this step (a `LoraBatch`), or None. It rides along with the
    # attention metadata so forward functions keep one small signature.
    lora: Any = None
    # The batch slot of each sequence of the step (decode: one per row), and in prefill the
    # token offsets where each sequence's chunk starts and ends (N + 1 entries): what layers
    # with a per-sequence state (linear attention) need to find and update it.
    seq_slots: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    _dense: dict = field(default_factory=dict, repr=False)

    def block_mask(self, spec: LayerSpec) -> BlockMask:
        return self.block_masks[spec.mask_key if self.decode else spec.window]

    def dense(self, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered slots and mask for the reference backend, built once per step per window
        (the same for every GQA group: the dense view evaluates one query row per sequence)."""
        if spec.window not in self._dense:
            self._dense[spec.window] = dense_view(self.block_mask(spec), self.decode)
        return self._dense[spec.window]


def decode_split(batch: int, num_kv_heads: int, max_pages: int, device: torch.device) -> int:
    """KV splits per (row, KV head) of flex's decode kernel: 2 x SMs / (batch x KV heads), at
    least one, at most the pages one sequence can hold. flex cuts the listed partial blocks of
    a row into SPLIT_KV even tiles (decode masks list no full blocks:
    `attention.masks.decode_block_mask` says why)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms // max(batch * num_kv_heads, 1) * 2, max_pages))


def decode_kernel_options(opts: dict | None, batch: int, num_kv_heads: int, max_pages: int,
                          device: torch.device, head_dim: int = 128, element_bytes: int = 2) -> dict:
    """flex decode's options, where the caller's (EngineConfig.flex_kernel_options) leave them.

    SPLIT_KV (`decode_split`) is capped at the pages one sequence can hold: flex splits each
    row's KV into SPLIT_KV tiles, by default 2 x SMs / (batch x kv heads) whatever the context,
    32 at batch 1 on an H200. Each tile is a whole number of BLOCK_N keys of the row's own pages,
    so splits beyond its page count run empty and still cost a launch slot and a share of the
    reduction (0.5 ms of a 3.7 ms Qwen3-4B step at batch 1).

    num_stages: flex's default on an H200 is one (no prefetch of the next KV block). Three cut
    a Qwen3-4B layer's decode attention at context 256 from 7.5 to 6.8 us at batch 1 and from
    16.1 to 13.6 us at batch 8; at batch 64, where the split is already 1, two are best
    (25.8 -> 25.0 us). Measured with benchmarks/attention_sweep.py on an H200. fp32 heads of more
    than 128 (Qwen3.5's 256 in fp32 tests) keep flex's one stage: three stages need 276 KB of
    shared memory, over the H200's 227 KB (Inductor's "out of resource"). 16-bit heads of 512
    (Gemma-4's full layers) take three: one stage read a 2,048-token context at 17 GB/s, 244 us
    per layer at batch 1, three at 278 GB/s, 15 us (H100, 2026-12-06). (A mask with full blocks
    needs 280 KB at three stages there; decode masks list none.)
    """
    opts = dict(opts or {})
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(batch * num_kv_heads, 1)
    if "SPLIT_KV" not in opts:
        opts["SPLIT_KV"] = decode_split(batch, num_kv_heads, max_pages, device)
    if element_bytes > 2 and head_dim > 128:
        opts.setdefault("num_stages", 1)
    opts.setdefault("num_stages", 3 if programs <= 2 * sms else 2)
    return opts


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, spec: LayerSpec,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq * D), attending the cache through the layer's block mask.

    `sinks` (Hq,): one learned logit per head that joins the softmax without a value (gpt-oss).
    Its effect is exact as a rescaling of the output: softmax over the keys and the sink is the
    keys' softmax times sigmoid(lse - sink), lse the keys' log-sum-exp."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if meta.backend == "reference":
        slots, mask = meta.dense(spec)
        out = reference_attention(q, k_cache, v_cache, slots, mask, spec.attention_scale, sinks)
        return out.reshape(tokens, num_heads * head_dim)
    block_mask = meta.block_mask(spec)
    flex = _flex(q.device, meta.decode)
    opts = meta.kernel_options or None
    lse_wanted = sinks is not None
    if meta.decode:
        q4 = q.view(tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if q.is_cuda:
            opts = decode_kernel_options(opts, tokens, num_kv_heads, block_mask.kv_indices.shape[-1],
                                         q.device, head_dim, q.element_size())
            out = _decode_fitting(flex, q4, k_cache, v_cache, block_mask, spec.attention_scale,
                                  opts, lse_wanted)
        else:
            out = flex(q4, k_cache, v_cache, block_mask=block_mask, scale=spec.attention_scale,
                       kernel_options=opts, return_lse=lse_wanted)
    else:
        # A packed prefill shorter than 128 tokens would otherwise be routed to flex's decode
        # kernel, whose BLOCK_M (next power of two of tokens x GQA group) can exceed the 128-row
        # query block, leaving inductor no valid config (NoValidChoicesError, seen on the H200).
        # (EngineConfig.flex_kernel_options are tuned for the decode kernel and not passed here.)
        opts = {"FORCE_USE_FLEX_ATTENTION": True}
        q4 = q.transpose(0, 1).unsqueeze(0)
        out = flex(q4, k_cache, v_cache, block_mask=block_mask, scale=spec.attention_scale,
                   enable_gqa=num_heads != num_kv_heads, kernel_options=opts, return_lse=lse_wanted)
    if lse_wanted:
        out, lse = out
    if not meta.decode:        # (1, Hq, T, ...) -> (T, Hq, ...)
        out = out.squeeze(0).transpose(0, 1)
        lse = lse.squeeze(0).transpose(0, 1) if lse_wanted else None
    out = out.reshape(tokens, num_heads, head_dim)
    if lse_wanted:
        out = out * torch.sigmoid(lse.reshape(tokens, num_heads).float() - sinks.float())[..., None].to(out.dtype)
    return out.reshape(tokens, num_heads * head_dim)


def _decode_fitting(flex, q4, k_cache, v_cache, block_mask, scale, opts: dict, lse_wanted: bool):
    """flex decode, compiled with one pipeline stage fewer each time Inductor finds the kernel
    out of shared memory (`compile.deepest_fitting`); the depth that fits is kept per (GQA
    group, head_dim, dtype, depth asked).
    `decode_kernel_options` picks depths measured to fit; this keeps a shape nobody measured (a
    wider GQA group, another GPU) from stopping the engine. The first decode of a shape compiles
    it in the graphs' warm-up, before any capture."""
    from torch._inductor.exc import InductorError

    def run(depth: int):
        return flex(q4, k_cache, v_cache, block_mask=block_mask, scale=scale,
                    kernel_options={**opts, "num_stages": depth}, return_lse=lse_wanted)

    asked = opts["num_stages"]
    return deepest_fitting(run, asked, ("flex decode", *q4.shape[-2:], q4.dtype, asked),
                           _FITTED_STAGES, InductorError, lambda err: "out of resource" in str(err))
