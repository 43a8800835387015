"""Llama-3 and Qwen3 forward math over the user's HF parameters (Qwen3 adds q/k RMSNorm).

Each layer is attention between two pure tensor functions, `qkv_rope` and `out_mlp`. On CUDA
they are compiled once (batch dimension dynamic) and reused by every layer and every graph
bucket: that fuses the norms, RoPE, SiLU-mul and residual adds that otherwise cost ~30 small
kernels per layer. In decode, one layer's `out_mlp` and the next layer's `qkv_rope` are compiled
as one region (`out_mlp_qkv_rope`), which fuses the residual add into the next input norm.
Layers wrapped by PEFT LoRA run the same math uncompiled, through `linear`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..attention.flex import AttentionMetadata, paged_attention
from ..kernels import qkv_epilogue as epilogue
from ..kernels import small_linear as gemv
from ..kernels.qkv_epilogue import qkv_epilogue
from ..kernels.small_linear import small_linear
from .base import LayerSpec, ModelSpec, apply_rope, in_row_chunks, linear, rms_norm, rope_tables

if TYPE_CHECKING:
    from ..attention.kv_cache import KVCache

_STATIC_ROPE_TYPES = {"default", "llama3", "linear", "yarn"}


def qkv_rope(x, ln_w, wq, bq, wk, bk, wv, bv, qn_w, kn_w, cos, sin, k_cache, v_cache, slot_mapping,
             eps: float, num_heads: int, num_kv_heads: int, head_dim: int, small: bool,
             decode: bool):
    """input norm -> q/k/v projections -> (Qwen3) q/k norm -> RoPE -> K/V stored in the cache.

    `small`: the batch is small enough for the GEMV kernel, which reads q, k and v in one launch.
    In decode on CUDA everything after the projections is one kernel (`qkv_epilogue`); in
    prefill it cost more than it saved (Llama-3.2-3B, 64 x 512 tokens on an H200: 39.2k tok/s
    with it, 56.6k without). Otherwise the cache write is an `index_copy_` on the whole 4-D
    cache tensor (a write through a view of it made inductor copy the whole cache).
    """
    h = rms_norm(x, ln_w, eps)
    tokens = h.shape[0]
    widths = [wq.shape[0], wk.shape[0], wv.shape[0]]
    if small:   # fp32 partials (split, tokens, widths), q/k/v side by side
        q, k, v = small_linear(h, wq, wk, wv).split(widths, dim=-1)
    else:
        q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
        bq = bk = bv = None     # added, as HF adds them, inside the GEMM
    same_bias = (bq is None) == (bk is None) == (bv is None)   # the kernel adds all three or none
    if decode and h.is_cuda and same_bias and epilogue.supported(head_dim, k_cache):
        return qkv_epilogue(q, k, v, bq, bk, bv, qn_w, kn_w, cos, sin, k_cache, v_cache, slot_mapping,
                            eps, num_heads, num_kv_heads)
    if small:
        q, k, v = (part.sum(0).to(h.dtype) for part in (q, k, v))
    q, k, v = _add_bias(q, bq), _add_bias(k, bk), _add_bias(v, bv)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v = v.reshape(tokens, num_kv_heads, head_dim)
    if qn_w is not None:
        q = rms_norm(q, qn_w, eps)
        k = rms_norm(k, kn_w, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache.index_copy_(2, slot_mapping, k.transpose(0, 1)[None].to(k_cache.dtype))
    v_cache.index_copy_(2, slot_mapping, v.transpose(0, 1)[None].to(v_cache.dtype))
    return q


def out_mlp(attn, residual, wo, bo, ln_w, w_gate, w_up, w_down, eps: float, small: bool):
    """o_proj + residual -> post-attention norm -> SwiGLU MLP + residual.

    `small`: GEMV kernels; gate and up are one launch that applies SiLU(gate) * up itself.
    (A one-kernel o_proj sum + residual + norm, one program per row, measured slower at batch 1
    than inductor's two kernels, whose split sum runs over many programs: BENCHMARKS.md.)
    """
    if not small:
        hidden = residual + F.linear(attn, wo, bo)
        h = rms_norm(hidden, ln_w, eps)
        return hidden + F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)
    hidden = residual + _add_bias(small_linear(attn, wo).sum(0).to(attn.dtype), bo)
    h = rms_norm(hidden, ln_w, eps)
    act = small_linear(h, w_gate, w_up, silu_mul=True)[0]
    return hidden + small_linear(act, w_down).sum(0).to(h.dtype)


def out_mlp_qkv_rope(attn, residual, out_args: tuple, qkv_args: tuple):
    """One layer's `out_mlp` and the next layer's `qkv_rope` as one compiled region, so the
    MLP's residual add and the next input norm are one kernel, not two."""
    hidden = out_mlp(attn, residual, *out_args)
    return qkv_rope(hidden, *qkv_args), hidden


def _add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


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
        self._qkv, self._out, self._out_qkv = qkv_rope, out_mlp, out_mlp_qkv_rope
        self.merged = None        # a MergedLora in lora_mode="merged"
        self.small_rows = 0  # set by prepare(): batches up to this many rows use the GEMV kernels
        self.mlp_chunk = 2048  # set by prepare(): rows per o_proj + MLP call in a long prefill

    def spec(self) -> ModelSpec:
        layer = LayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        return ModelSpec(
            layers=[layer] * len(self.body.layers),
            vocab_size=self.hf.lm_head.weight.shape[0],
            hidden_size=self.config.hidden_size,
            max_position_embeddings=self.config.max_position_embeddings,
        )

    def prepare(self, max_len: int, compile_layers: bool, small_rows: int = 0,
                mlp_chunk: int = 2048) -> None:
        """Build the cos/sin tables from the model's own inv_freq buffer (its rope scaling), on the
        weights' device: Unsloth's rotary embedding keeps inv_freq on the CPU."""
        self.mlp_chunk = mlp_chunk
        rotary = self.body.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet")
        inv_freq = rotary.inv_freq.to(self.body.embed_tokens.weight.device)
        self._rope_cache = rope_tables(inv_freq, float(getattr(rotary, "attention_scaling", 1.0)),
                                       max_len, self.dtype)
        self.small_rows = min(small_rows, gemv.MAX_ROWS) if self._kernel_shapes_ok() else 0
        if compile_layers:
            self._qkv = torch.compile(qkv_rope, dynamic=True, fullgraph=True)
            self._out = torch.compile(out_mlp, dynamic=True, fullgraph=True)
            self._out_qkv = torch.compile(out_mlp_qkv_rope, dynamic=True, fullgraph=True)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: "KVCache") -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, hidden)."""
        cos_table, sin_table = self._rope_cache
        cos, sin = cos_table[meta.positions], sin_table[meta.positions]
        hidden = F.embedding(input_ids, self.body.embed_tokens.weight).to(self.dtype)
        tokens = hidden.shape[0]
        small = hidden.is_cuda and tokens <= self.small_rows
        layers = self.body.layers
        q = None     # the current layer's queries when the previous region computed them
        for index, layer in enumerate(layers):
            if self._lora_path(layer, meta):
                hidden = self._lora_layer(index, layer, hidden, cos, sin, meta, cache)
                continue
            if q is None:
                q = self._qkv(hidden, *self._qkv_args(index, cos, sin, meta, cache, small))
            out = paged_attention(q, cache.k[index], cache.v[index], meta, self.scale, self.window)
            out_args = self._out_args(layer, small)
            following = layers[index + 1] if index + 1 < len(layers) else None
            # Decode only: a prefill is compute-bound, and a region compiled for its shapes too
            # would add seconds to start-up for nothing.
            if meta.decode and following is not None and not self._lora_path(following, meta):
                q, hidden = self._out_qkv(out, hidden, out_args,
                                          self._qkv_args(index + 1, cos, sin, meta, cache, small))
            else:
                hidden = in_row_chunks(self._out, self.mlp_chunk, out, hidden, *out_args)
                q = None
        return rms_norm(hidden, self.body.norm.weight, self.eps)

    def _lora_path(self, layer: torch.nn.Module, meta: AttentionMetadata) -> bool:
        """Whether a layer runs through `linear` (LoRARequest rows, or live PEFT wrappers)."""
        return meta.lora is not None or (self.merged is None and _has_lora(layer))

    def _qkv_args(self, index, cos, sin, meta, cache, small: bool) -> tuple:
        """`qkv_rope`'s arguments after its input, for layer `index`."""
        attn, w = self.body.layers[index].self_attn, self._weight
        return (self.body.layers[index].input_layernorm.weight, w(attn.q_proj), _bias(attn.q_proj),
                w(attn.k_proj), _bias(attn.k_proj), w(attn.v_proj), _bias(attn.v_proj),
                attn.q_norm.weight if self.qk_norm else None,
                attn.k_norm.weight if self.qk_norm else None, cos, sin,
                cache.k[index], cache.v[index], meta.slot_mapping,
                self.eps, self.num_heads, self.num_kv_heads, self.head_dim, small, meta.decode)

    def _out_args(self, layer: torch.nn.Module, small: bool) -> tuple:
        """`out_mlp`'s arguments after the attention output and the residual."""
        attn, mlp, w = layer.self_attn, layer.mlp, self._weight
        return (w(attn.o_proj), _bias(attn.o_proj), layer.post_attention_layernorm.weight,
                w(mlp.gate_proj), w(mlp.up_proj), w(mlp.down_proj), self.eps, small)

    def _weight(self, module: torch.nn.Module) -> torch.Tensor:
        if self.merged is not None:
            return self.merged.weight(module)
        return module.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.hf.lm_head, self.small_rows).float()

    def _kernel_shapes_ok(self) -> bool:
        """The GEMV kernel needs every projection on CUDA, contiguous, K a multiple of its block."""
        for layer in self.body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                           mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if not gemv.weight_supported(getattr(module, "base_layer", module).weight):
                    return False
        return True

    def _lora_layer(self, index, layer, hidden, cos, sin, meta, cache) -> torch.Tensor:
        """The same layer math through `linear`, which reads PEFT LoRA wrappers live, plus the
        deltas of adapters named by LoRARequest for the rows that asked for them."""
        attn = layer.self_attn
        x = rms_norm(hidden, layer.input_layernorm.weight, self.eps)
        tokens = x.shape[0]
        q = self._proj(x, attn.q_proj, index, "q_proj", meta).view(tokens, self.num_heads, self.head_dim)
        k = self._proj(x, attn.k_proj, index, "k_proj", meta).view(tokens, self.num_kv_heads, self.head_dim)
        v = self._proj(x, attn.v_proj, index, "v_proj", meta).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = rms_norm(q, attn.q_norm.weight, self.eps)
            k = rms_norm(k, attn.k_norm.weight, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(index, k, v, meta.slot_mapping)
        out = paged_attention(q, cache.k[index], cache.v[index], meta, self.scale, self.window)
        # LoRARequest deltas index rows of the whole batch, so those steps run unchunked.
        chunk = self.mlp_chunk if meta.lora is None else tokens
        return in_row_chunks(self._lora_out_mlp, chunk, out, hidden, layer, index, meta)

    def _lora_out_mlp(self, out, residual, layer, index, meta) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        hidden = residual + self._proj(out, attn.o_proj, index, "o_proj", meta)
        h = rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
        # In place: the gate output is ours, and this eager path has no compiler to reuse buffers.
        act = F.silu(self._proj(h, mlp.gate_proj, index, "gate_proj", meta), inplace=True)
        act.mul_(self._proj(h, mlp.up_proj, index, "up_proj", meta))
        return hidden + self._proj(act, mlp.down_proj, index, "down_proj", meta)

    def _proj(self, x, module, index, name, meta) -> torch.Tensor:
        out = linear(x, module, self.small_rows)
        return out if meta.lora is None else meta.lora.add(index, name, x, out)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each adaptable projection, for validating LoRA adapters."""
        layer = self.body.layers[0]
        mods = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj,
                "v_proj": layer.self_attn.v_proj, "o_proj": layer.self_attn.o_proj,
                "gate_proj": layer.mlp.gate_proj, "up_proj": layer.mlp.up_proj,
                "down_proj": layer.mlp.down_proj}
        return {name: tuple(getattr(m, "base_layer", m).weight.shape) for name, m in mods.items()}


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    return getattr(module, "base_layer", module).bias


def _has_lora(layer: torch.nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    return any(hasattr(m, "base_layer") for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                  mlp.gate_proj, mlp.up_proj, mlp.down_proj))
