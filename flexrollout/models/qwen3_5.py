"""Qwen3.5 (`qwen3_5`, dense) and Qwen3.5-MoE / Qwen3.6-A3B (`qwen3_5_moe`): hybrid decoders whose
layers are either GatedDeltaNet linear attention (a fixed-size state per sequence) or gated full
attention, each followed by a dense MLP or a MoE block with a shared expert.

- Every RMSNorm but GatedDeltaNet's output norm is zero-centred: x̂ · (1 + w), in fp32, then cast.
- Full attention: q_proj yields query and a per-head gate ([query | gate] per head); q/k norms;
  RoPE on the first `partial_rotary_factor` of head_dim (HF's interleaved mrope reduces to plain
  NeoX rope for text positions, where the three position rows are equal); out · σ(gate) before o_proj.
- GatedDeltaNet: in_proj_qkv -> depthwise causal conv1d + SiLU -> q, k (Hk heads), v (Hv heads);
  β = σ(in_proj_b), g = −exp(A_log) · softplus(in_proj_a + dt_bias); the gated delta rule
  (layers/gated_delta.py) over q/k repeated to Hv heads; w · norm(o) · silu(in_proj_z) -> out_proj.
- MoE: softmax router, top-k renormalised, stacked experts as Qwen3-MoE's, plus a shared expert
  scaled by σ(shared_expert_gate(h)).

The multimodal checkpoints (`Qwen3_5ForConditionalGeneration`) run their language model over the
wrapper's own parameters; image and video inputs are refused where prompts are parsed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.flex import paged_attention
from ..attention.kv_cache import store_kv
from ..layers import gated_delta as gdn
from ..layers.linear import Kernels, Linear, finish_group, linear, project_group
from ..layers.mlp import activation, gated_mlp
from ..layers.moe import Experts, experts_forward, read_experts, route_softmax_topk
from ..layers.norm import LLAMA, OFFSET, rms_norm
from ..layers.rope import apply_rope
from ..spec import ATTENTION, LINEAR, LayerSpec, ModelSpec, StateSpec
from .base import DecoderForward, LayerFns, Step, text_model
from .llama import attention_out_mlp

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# -- layer functions ------------------------------------------------------------------------------
def gated_attention_inputs(x: torch.Tensor, ln_w: torch.Tensor, q: Linear, k: Linear, v: Linear,
                           qn_w: torch.Tensor, kn_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                           kernels: Kernels):
    """input norm -> q (+ gate) / k / v -> q/k norms -> partial RoPE -> K/V stored. Returns
    (queries (T, heads, head_dim), gate (T, heads * head_dim))."""
    h = rms_norm(x, ln_w, eps, OFFSET)
    projections = [q, k, v]
    qg, ks, vs = finish_group(project_group(h, projections, kernels), projections, h.dtype)
    tokens = h.shape[0]
    query, gate = qg.view(tokens, num_heads, 2 * head_dim).chunk(2, dim=-1)
    query = rms_norm(query, qn_w, eps, OFFSET)
    ks = rms_norm(ks.view(tokens, num_kv_heads, head_dim), kn_w, eps, OFFSET)
    query, ks = apply_rope(query, cos, sin), apply_rope(ks, cos, sin)
    store_kv(k_cache, v_cache, ks, vs.view(tokens, num_kv_heads, head_dim), slot_mapping)
    return query, gate.reshape(tokens, num_heads * head_dim)


def linear_attention_inputs(x: torch.Tensor, ln_w: torch.Tensor, qkv: Linear, z: Linear, b: Linear,
                            a: Linear, a_log: torch.Tensor, dt_bias: torch.Tensor, eps: float,
                            kernels: Kernels):
    """input norm -> the GatedDeltaNet projections and gates. Returns (mixed q/k/v before the conv
    (T, conv_dim), z (T, value_dim), beta (T, Hv), g (T, Hv) fp32)."""
    h = rms_norm(x, ln_w, eps, OFFSET)
    grouped = [qkv, z, b]                # one GEMV launch for small batches
    mixed, gate, b_out = finish_group(project_group(h, grouped, kernels), grouped, h.dtype)
    beta = torch.sigmoid(b_out)
    g = -a_log.float().exp() * F.softplus(linear(h, a, kernels).float() + dt_bias)
    return mixed, gate, beta, g


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w · norm(o) · silu(z) per value head, rounding where HF does: o (T, Hv, dv), z (T, Hv * dv)."""
    normed = rms_norm(o, weight, eps, LLAMA)
    return (normed * F.silu(z.view(o.shape).float())).to(o.dtype)


def out_shared_moe(attn: torch.Tensor, residual: torch.Tensor, o: Linear, ln_w: torch.Tensor,
                   router: Linear, experts: Experts, top_k: int, shared_gate: Linear,
                   gate: Linear, up: Linear, down: Linear, act, eps: float, kernels: Kernels) -> torch.Tensor:
    """output projection + residual -> post norm -> routed experts + gated shared expert + residual."""
    hidden = residual + linear(attn, o, kernels)
    h = rms_norm(hidden, ln_w, eps, OFFSET)
    weights, ids = route_softmax_topk(h, router, top_k, True, kernels)
    routed = experts_forward(h, weights, ids, experts, kernels.expert_rows)
    shared = gated_mlp(h, gate, up, down, act, kernels) * torch.sigmoid(linear(h, shared_gate, kernels))
    return hidden + (routed + shared)


# -- the architecture -----------------------------------------------------------------------------
class Qwen3_5Forward(DecoderForward):
    LORA_TARGETS = ATTENTION_PROJECTIONS + LINEAR_PROJECTIONS + MLP_PROJECTIONS + (
        "shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate")
    NORM = OFFSET

    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype, merged=None,
                 linear_backend: str = "auto") -> None:
        self.body = text_model(hf_model)
        self.config = hf_model.config.get_text_config()
        self.eps = self.config.rms_norm_eps
        self.act = activation(self.config.hidden_act)
        if linear_backend not in ("auto", "fla", "torch"):
            raise ValueError(f"linear_backend must be 'auto', 'fla' or 'torch', got {linear_backend!r}")
        self.linear_backend = linear_backend     # the prefill rule's kernels (gated_delta.use_fla)
        super().__init__(hf_model, dtype, merged)

    def is_linear(self, index: int) -> bool:
        return self.config.layer_types[index] == "linear_attention"

    def is_moe(self, index: int) -> bool:
        return hasattr(self.body.layers[index].mlp, "experts")

    # -- the engine's view -------------------------------------------------------------------
    def build_spec(self) -> ModelSpec:
        cfg = self.config
        return ModelSpec(layers=[self.layer_spec(i) for i in range(len(self.body.layers))],
                         vocab_size=self.hf.lm_head.weight.shape[0], hidden_size=cfg.hidden_size,
                         max_position_embeddings=cfg.max_position_embeddings)

    def layer_spec(self, index: int) -> LayerSpec:
        cfg = self.config
        ffn = "moe" if self.is_moe(index) else "mlp"
        if not self.is_linear(index):
            return LayerSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                             head_dim=cfg.head_dim, mixer=ATTENTION, ffn=ffn)
        heads_k, heads_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * heads_k * dk + heads_v * dv
        states = (StateSpec("conv", (conv_dim, cfg.linear_conv_kernel_dim), self.dtype),
                  StateSpec("recurrent", (heads_v, dk, dv), torch.float32))
        return LayerSpec(num_heads=heads_v, num_kv_heads=heads_k, head_dim=dv, mixer=LINEAR, ffn=ffn,
                         states=states)

    def layer_fns(self, index: int) -> LayerFns:
        pre = linear_attention_inputs if self.is_linear(index) else gated_attention_inputs
        return LayerFns(pre=pre, post=out_shared_moe if self.is_moe(index) else attention_out_mlp)

    def projections(self, index: int) -> dict[str, torch.nn.Module]:
        layer = self.body.layers[index]
        if self.is_linear(index):
            modules = {name: getattr(layer.linear_attn, name) for name in LINEAR_PROJECTIONS}
        else:
            modules = {name: getattr(layer.self_attn, name) for name in ATTENTION_PROJECTIONS}
        mlp = layer.mlp
        if self.is_moe(index):
            shared = mlp.shared_expert
            modules.update(shared_gate_proj=shared.gate_proj, shared_up_proj=shared.up_proj,
                           shared_down_proj=shared.down_proj, shared_expert_gate=mlp.shared_expert_gate)
        else:
            modules.update({name: getattr(mlp, name) for name in MLP_PROJECTIONS})
        return modules

    def read_experts(self, index: int) -> Experts | None:
        if not self.is_moe(index):
            return None
        return read_experts(self.body.layers[index].mlp.experts, self.merged)

    # -- arguments of the layer functions ----------------------------------------------------
    def pre_args(self, index: int, step: Step) -> tuple:
        layer, spec, lin = self.body.layers[index], self.spec.layers[index], self.linear
        if self.is_linear(index):
            attn = layer.linear_attn
            return (layer.input_layernorm.weight, lin(index, "in_proj_qkv", step),
                    lin(index, "in_proj_z", step), lin(index, "in_proj_b", step),
                    lin(index, "in_proj_a", step), attn.A_log, attn.dt_bias, self.eps, step.kernels)
        attn = layer.self_attn
        cos, sin = step.rope["default"]
        return (layer.input_layernorm.weight, lin(index, "q_proj", step), lin(index, "k_proj", step),
                lin(index, "v_proj", step), attn.q_norm.weight, attn.k_norm.weight, cos, sin,
                step.cache.k[index], step.cache.v[index], step.meta.slot_mapping, self.eps,
                spec.num_heads, spec.num_kv_heads, spec.head_dim, step.kernels)

    def post_args(self, index: int, step: Step) -> tuple:
        layer, lin = self.body.layers[index], self.linear
        out = lin(index, "out_proj" if self.is_linear(index) else "o_proj", step)
        norm = layer.post_attention_layernorm.weight
        if self.is_moe(index):
            return (out, norm, Linear(layer.mlp.gate.weight), self.layer_experts(index, step),
                    self.config.num_experts_per_tok, lin(index, "shared_expert_gate", step),
                    lin(index, "shared_gate_proj", step), lin(index, "shared_up_proj", step),
                    lin(index, "shared_down_proj", step), self.act, self.eps, step.kernels)
        return (out, norm, lin(index, "gate_proj", step), lin(index, "up_proj", step),
                lin(index, "down_proj", step), self.act, self.eps, OFFSET, step.kernels)


    # -- token mixers ------------------------------------------------------------------------
    def mix(self, index: int, spec: LayerSpec, mixer_in, step: Step) -> torch.Tensor:
        if spec.mixer == LINEAR:
            return self.linear_attention(index, spec, *mixer_in, step)
        query, gate = mixer_in
        out = paged_attention(query, step.cache.k[index], step.cache.v[index], step.meta, spec)
        return out * torch.sigmoid(gate)

    def linear_attention(self, index: int, spec: LayerSpec, mixed: torch.Tensor, z: torch.Tensor,
                         beta: torch.Tensor, g: torch.Tensor, step: Step) -> torch.Tensor:
        """Conv and gated delta rule from each sequence's state, which they update in place;
        then the gated output norm. Returns (T, Hv * dv). Decode is one compiled region on CUDA
        (as `pre` / `post`), captured with the rest of the step; prefill runs eagerly (fla's
        kernels are opaque to the compiler)."""
        attn = self.body.layers[index].linear_attn
        pools, meta = step.cache.states[index], step.meta
        heads = (spec.num_kv_heads, self.config.linear_key_head_dim, spec.num_heads, spec.head_dim)
        args = (mixed, z, beta, g, attn.conv1d.weight.squeeze(1), attn.norm.weight, pools["conv"],
                pools["recurrent"], meta.seq_slots, heads, self.eps)
        if meta.decode:
            fla = (self.options.fla_decode and gdn.use_fla(mixed, self.linear_backend)
                   and gdn.fla_decode_kernel() is not None)
            return self._fn(linear_attention_decode, meta)(*args, fla)
        return linear_attention_prefill(*args, meta.positions, meta.cu_seqlens, self.linear_backend)


def split_heads(conv_out: torch.Tensor, heads: tuple[int, int, int, int], repeat_keys: bool = True):
    """q, k (T, Hv, dk) (each key head repeated for its group of value heads; with
    `repeat_keys=False` (T, Hk, dk), for kernels that map the groups themselves), v (T, Hv, dv);
    `heads` = (Hk, dk, Hv, dv)."""
    key_heads, dk, value_heads, dv = heads
    tokens = conv_out.shape[0]
    q, k, v = conv_out.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    q, k = (x.reshape(tokens, key_heads, dk) for x in (q, k))
    if repeat_keys:
        q, k = (x.repeat_interleave(value_heads // key_heads, dim=1) for x in (q, k))
    return q, k, v.reshape(tokens, value_heads, dv)


def linear_attention_decode(mixed, z, beta, g, conv_w, norm_w, conv_pool, rec_pool, slots, heads, eps,
                            fla: bool = False):
    """One token per sequence (B rows), states read from and written back to their slots;
    `fla`: the rule through fla's kernel, in place in the pool (the torch step reads a gathered
    copy and writes it back: three passes over every state where fla's kernel makes one)."""
    conv_out, history = gdn.conv_decode(mixed, conv_w, conv_pool.index_select(0, slots))
    conv_pool.index_copy_(0, slots, history)
    if fla:
        q, k, v = split_heads(conv_out, heads, repeat_keys=False)
        out = gdn.fla_decode_step(q, k, v, g, beta, rec_pool, slots)
    else:
        q, k, v = split_heads(conv_out, heads)
        out, state = gdn.recurrent_step(q, k, v, g, beta, rec_pool.index_select(0, slots))
        rec_pool.index_copy_(0, slots, state)
    return gated_rms_norm(out.to(mixed.dtype), z, norm_w, eps).flatten(1)


def linear_attention_prefill(mixed, z, beta, g, conv_w, norm_w, conv_pool, rec_pool, slots, heads, eps,
                             positions, cu_seqlens, backend: str):
    """Packed chunks of several sequences (cu_seqlens); a chunk at position 0 starts from zeros."""
    seq, offset = gdn.packed_layout(cu_seqlens, mixed.shape[0])
    fresh = positions.index_select(0, cu_seqlens[:-1].long()) == 0
    conv_out, history = gdn.conv_prefill(mixed, conv_w, gdn.start_states(conv_pool, slots, fresh),
                                         seq, offset, cu_seqlens)
    conv_pool.index_copy_(0, slots, history)
    q, k, v = split_heads(conv_out, heads)
    out, state = gdn.rule_prefill(q, k, v, g, beta, gdn.start_states(rec_pool, slots, fresh),
                                  seq, offset, cu_seqlens, backend)
    rec_pool.index_copy_(0, slots, state)
    return gated_rms_norm(out.to(mixed.dtype), z, norm_w, eps).flatten(1)
