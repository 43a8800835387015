"""Llama-3 and Qwen3 forward math over the user's HF parameters (Qwen3 adds q/k RMSNorm)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.flex import AttentionMetadata, paged_attention

if TYPE_CHECKING:
    from ..attention.kv_cache import KVCache
from .base import LayerSpec, ModelSpec, apply_rope, linear, rms_norm, rope_tables

_STATIC_ROPE_TYPES = {"default", "llama3", "linear", "yarn"}


class LlamaForward:
    """Reads `hf_model.model.layers[i].self_attn.q_proj` etc. directly; holds no weight copies."""

    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.hf = hf_model
        self.body = hf_model.model
        cfg = hf_model.config
        self.config = cfg
        self.dtype = dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.qk_norm = hasattr(self.body.layers[0].self_attn, "q_norm")
        self.window = None
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def spec(self) -> ModelSpec:
        layer = LayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        return ModelSpec(
            layers=[layer] * len(self.body.layers),
            vocab_size=self.hf.lm_head.weight.shape[0],
            hidden_size=self.config.hidden_size,
            max_position_embeddings=self.config.max_position_embeddings,
        )

    def prepare(self, max_len: int) -> None:
        """Build the cos/sin tables from the model's own inv_freq buffer (its rope scaling)."""
        rotary = self.body.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet")
        self._rope_cache = rope_tables(rotary.inv_freq, float(rotary.attention_scaling),
                                       max_len, self.dtype)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: "KVCache") -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, hidden)."""
        cos_table, sin_table = self._rope_cache
        cos, sin = cos_table[meta.positions], sin_table[meta.positions]
        hidden = F.embedding(input_ids, self.body.embed_tokens.weight).to(self.dtype)
        for index, layer in enumerate(self.body.layers):
            hidden = hidden + self._attention(index, layer, hidden, cos, sin, meta, cache)
            hidden = hidden + self._mlp(layer.mlp, rms_norm(
                hidden, layer.post_attention_layernorm.weight, self.eps))
        return rms_norm(hidden, self.body.norm.weight, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.hf.lm_head).float()

    def _attention(self, index, layer, hidden, cos, sin, meta, cache) -> torch.Tensor:
        attn = layer.self_attn
        x = rms_norm(hidden, layer.input_layernorm.weight, self.eps)
        tokens = x.shape[0]
        q = linear(x, attn.q_proj).view(tokens, self.num_heads, self.head_dim)
        k = linear(x, attn.k_proj).view(tokens, self.num_kv_heads, self.head_dim)
        v = linear(x, attn.v_proj).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = rms_norm(q, attn.q_norm.weight, self.eps)
            k = rms_norm(k, attn.k_norm.weight, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(index, k, v, meta.slot_mapping)
        out = paged_attention(q, cache.k[index], cache.v[index], meta, self.scale, self.window)
        return linear(out, attn.o_proj)

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, mlp.gate_proj)) * linear(x, mlp.up_proj), mlp.down_proj)
