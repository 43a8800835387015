"""Shared layer building blocks against HF transformers' own functions on the same inputs."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    apply_rotary_pos_emb as qwen35_rope,
)

from flexrollout.layers.rope import apply_rope


def _hf(rope, q, k, cos, sin):
    """HF's layout: (batch, heads, T, head_dim) and (batch, T, rotary)."""
    hq, hk = rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return hq[0].transpose(0, 1), hk[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary,hf_rope", [(64, llama_rope), (16, qwen35_rope)],
                         ids=["full", "partial"])
def test_rope_equals_hf_bitwise(dtype, rotary, hf_rope):
    """Full-head RoPE equals Llama's and partial RoPE (a quarter of the head, the rest passed
    through) Qwen3.5's, bit for bit in eager mode."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, heads, 64, generator=g).to(dtype) for heads in (4, 2))
    cos, sin = (torch.randn(5, rotary, generator=g).to(dtype) for _ in range(2))
    hq, hk = _hf(hf_rope, q, k, cos, sin)
    assert torch.equal(apply_rope(q, cos, sin), hq)
    assert torch.equal(apply_rope(k, cos, sin), hk)


@pytest.mark.parametrize("rotary", [64, 16], ids=["full", "partial"])
def test_rope_compiled_matches_hf(rotary):
    """Compiled as the engine compiles its layers (the roll and selects fuse there), in fp32."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 64, generator=g)
    cos, sin = torch.randn(3, rotary, generator=g), torch.randn(3, rotary, generator=g)
    hq, _ = _hf(qwen35_rope if rotary < 64 else llama_rope, q, q, cos, sin)
    compiled = torch.compile(apply_rope, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q, cos, sin), hq, rtol=1e-6, atol=1e-6)
