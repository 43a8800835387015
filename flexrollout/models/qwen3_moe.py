"""Qwen3-MoE: Qwen3's attention, and per layer either a sparse MoE block or a dense MLP.

Router: fp32 softmax over the experts -> top-k -> renormalised when `norm_topk_prob`. Experts
are stacked parameters, `gate_up_proj` (E, 2I, H) gate first and `down_proj` (E, H, I), read in
place. `mlp_only_layers` and `decoder_sparse_step` choose the dense layers.
"""
from __future__ import annotations

import torch

from ..layers.linear import Kernels, Linear, linear
from ..layers.moe import Experts, experts_forward, read_experts, route_softmax_topk
from ..layers.norm import rms_norm
from .base import LayerFns, Step
from .llama import LlamaForward


def attention_out_moe(attn: torch.Tensor, residual: torch.Tensor, o: Linear, ln_w: torch.Tensor,
                      router: Linear, experts: Experts, top_k: int, renormalize: bool,
                      eps: float, norm_style: str, kernels: Kernels) -> torch.Tensor:
    """o_proj + residual -> post-attention norm -> routed experts + residual."""
    hidden = residual + linear(attn, o, kernels)
    h = rms_norm(hidden, ln_w, eps, norm_style)
    weights, ids = route_softmax_topk(h, router, top_k, renormalize, kernels)
    return hidden + experts_forward(h, weights, ids, experts, kernels.expert_rows)


class Qwen3MoeForward(LlamaForward):
    def ffn_kind(self, index: int) -> str:
        cfg = self.config
        sparse = (index not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0
                  and (index + 1) % cfg.decoder_sparse_step == 0)
        return "moe" if sparse else "mlp"

    def layer_fns(self, index: int) -> LayerFns:
        if self.spec.layers[index].ffn == "moe":
            return LayerFns(pre=super().layer_fns(index).pre, post=attention_out_moe)
        return super().layer_fns(index)

    def read_experts(self, index: int) -> Experts | None:
        if self.spec.layers[index].ffn != "moe":
            return None
        return read_experts(self.body.layers[index].mlp.experts, self.merged)

    def post_args(self, index: int, step: Step) -> tuple:
        if self.spec.layers[index].ffn != "moe":
            return super().post_args(index, step)
        layer = self.body.layers[index]
        return (self.linear(index, "o_proj", step), layer.post_attention_layernorm.weight,
                Linear(layer.mlp.gate.weight), self.layer_experts(index, step), self.config.num_experts_per_tok,
                bool(self.config.norm_topk_prob), self.eps, self.NORM, step.kernels)
