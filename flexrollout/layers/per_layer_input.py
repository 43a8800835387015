"""Per-layer inputs (Gemma-3n / Gemma-4 "PLE"): besides the token embedding, every token gets a
small vector per decoder layer, and each layer adds a gated projection of its vector to the
residual stream.

The per-layer vectors come from two parts, combined as (context + token) * 2^-1/2: a token-
identity part, a lookup in a packed (vocab, layers * P) table times sqrt(P), and a context part,
the scaled token embedding projected to (layers * P) times hidden^-1/2 and RMS-normalised per
layer (all as transformers' Gemma4TextModel computes them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import Kernels, Linear, linear
from .norm import rms_norm


@dataclass(frozen=True)
class PerLayerInputBlock:
    """One layer's per-layer-input residual block (the model's own tensors)."""

    gate: Linear                # hidden -> P
    projection: Linear          # P -> hidden
    norm_w: torch.Tensor        # (hidden,) RMSNorm after the projection


def per_layer_inputs(input_ids: torch.Tensor, embeds: torch.Tensor, table: torch.Tensor,
                     table_scale: torch.Tensor, projection: Linear, projection_scale: float,
                     norm_w: torch.Tensor, num_layers: int, eps: float, norm_style: str,
                     kernels: Kernels) -> torch.Tensor:
    """Every token's per-layer vectors (T, num_layers, P); `embeds` are the scaled token
    embeddings (T, hidden). The context projection (hidden -> layers * P: 1,536 x 8,960 on E2B)
    takes the step's kernels, the GEMV in small decode steps, as every layer's projections do."""
    tokens = input_ids.shape[0]
    identity = F.embedding(input_ids, table) * table_scale.to(table.dtype)
    identity = identity.reshape(tokens, num_layers, -1).to(embeds.dtype)
    context = (linear(embeds, projection, kernels) * projection_scale).reshape(tokens, num_layers, -1)
    context = rms_norm(context, norm_w, eps, norm_style)
    return (context + identity) * 2.0 ** -0.5


def per_layer_input_residual(hidden: torch.Tensor, per_layer_input: torch.Tensor,
                             block: PerLayerInputBlock, act, eps: float, norm_style: str,
                             kernels: Kernels) -> torch.Tensor:
    """hidden + norm(projection(act(gate(hidden)) * per_layer_input)); per_layer_input (T, P)."""
    gated = act(linear(hidden, block.gate, kernels)) * per_layer_input
    return hidden + rms_norm(linear(gated, block.projection, kernels), block.norm_w, eps, norm_style)
