"""What an architecture tells the engine: one `LayerSpec` per decoder layer, and a `ModelSpec`.

The engine sizes the KV cache, builds attention masks and picks kernels from these alone, without
knowing the architecture. Every layer says what its token mixer is (attention over KV pages, or a
linear-attention layer that keeps a fixed-size state per sequence), the attention's own shape
(heads, KV heads, head_dim, sliding window, softmax scale, sinks), where its KV lives (its own
pages, or those of an earlier layer it shares them with), and what its feed-forward block is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION = "attention"
LINEAR = "linear"           # a recurrent state per sequence instead of KV pages (GatedDeltaNet)
FFN_KINDS = ("mlp", "moe", "mlp+moe")


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence state tensor of a linear-attention layer (shape without the batch)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer, as the engine sees it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    mixer: str = ATTENTION
    # Sliding window in tokens, the current token included (kv > q - window); None: full.
    window: int | None = None
    # Softmax scale of the attention scores; None means head_dim ** -0.5.
    scale: float | None = None
    # Learned per-head sink logits (gpt-oss): softmax over the keys plus one extra logit.
    sinks: bool = False
    # Index of an earlier layer whose KV this layer reads instead of computing its own.
    kv_source: int | None = None
    ffn: str = "mlp"
    # Per-sequence state of a linear-attention layer (empty for attention layers).
    states: tuple[StateSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.mixer not in (ATTENTION, LINEAR):
            raise ValueError(f"mixer must be {ATTENTION!r} or {LINEAR!r}, got {self.mixer!r}")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        if self.mixer == ATTENTION and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def owns_kv(self) -> bool:
        """Whether the layer has KV pages of its own."""
        return self.mixer == ATTENTION and self.kv_source is None

    @property
    def mask_key(self) -> tuple[int | None, int]:
        """What distinguishes this layer's decode block mask: its window and GQA group (decode
        folds the group into the query axis, so the mask's query length is the group)."""
        return self.window, self.group


@dataclass
class ModelSpec:
    """Architecture facts the engine loop needs."""

    layers: list[LayerSpec]
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int

    @property
    def attention_layers(self) -> list[LayerSpec]:
        return [layer for layer in self.layers if layer.mixer == ATTENTION]

    @property
    def mask_keys(self) -> list[tuple[int | None, int]]:
        """Distinct decode mask keys, in a stable order (full attention first)."""
        keys = {layer.mask_key for layer in self.attention_layers}
        return sorted(keys, key=lambda key: (key[0] is not None, key[0] or 0, key[1]))

    @property
    def windows(self) -> list[int | None]:
        """Distinct windows (prefill masks do not depend on the GQA group)."""
        return sorted({key[0] for key in self.mask_keys}, key=lambda w: (w is not None, w or 0))
