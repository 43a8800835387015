"""The fused q/k/v epilogue (partial sums, bias, q/k norm, RoPE, K/V store) against HF's own
Qwen3 / Gemma-4 RMSNorm and rotary functions in float64, run by Triton's interpreter on CPU (and
natively on CUDA when present)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import run_fresh_python

pytest.importorskip("triton")

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernel is built.
_CHECK = textwrap.dedent("""
    import torch
    torch.set_grad_enabled(False)
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb
    from flexrollout.kernels.qkv_epilogue import qkv_epilogue
    torch.manual_seed(0)
    device = "{device}"
    dtype = getattr(torch, "{dtype}")
    T, H, HKV, D, SPLIT, SLOTS = {tokens}, {heads}, {kv_heads}, {head_dim}, {split}, 64
    N = (H + 2 * HKV) * D
    widths = [H * D, HKV * D, HKV * D]
    parts = torch.randn(SPLIT, T, N, device=device) if SPLIT else None
    if SPLIT:                     # the GEMV's fp32 partials: column views of one tensor
        srcs = parts.split(widths, dim=-1)
        full = parts.sum(0).to(dtype)
    else:                         # three separate projections in the model dtype
        srcs = [torch.randn(T, w, device=device).to(dtype) for w in widths]
        full = torch.cat(srcs, dim=-1)
    bias = [torch.randn(w, device=device).to(dtype) for w in widths] if {bias} else [None] * 3
    gemma, k_eq_v = "{style}" != "qwen3", "{style}" == "gemma4_k_eq_v"
    if k_eq_v:                    # V is k_proj's raw output: the kernel reads k's columns twice
        srcs = [srcs[0], srcs[1], srcs[1]]
    qn_w, kn_w = ((torch.rand(D, device=device) + 0.5).to(dtype) for _ in range(2))
    if not {norm}:
        qn_w = kn_w = None
    positions = torch.randint(0, 500, (T,), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).double() / D))
    freqs = positions[:, None].double() * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache = torch.full((1, HKV, SLOTS, D), 7.0, device=device, dtype=dtype)
    v_cache = torch.full((1, HKV, SLOTS, D), 7.0, device=device, dtype=dtype)
    slots = torch.randperm(SLOTS, device=device)[:T]
    q = qkv_epilogue(*srcs, *bias, qn_w, kn_w, cos, sin, k_cache, v_cache, slots, 1e-6, H, HKV,
                     norm_fp32=gemma, v_norm=gemma)

    # HF's math in float64 on the rounded projection output.
    x = full.double()
    if {bias}:
        x = x + torch.cat(bias).double()
    rq, rk, rv = x.split(widths, dim=-1)
    rq, rk, rv = rq.view(T, H, D), rk.view(T, HKV, D), rv.view(T, HKV, D)
    if k_eq_v:
        rv = rk
    def hf_norm(x, weight):
        norm = (Gemma4RMSNorm(D, eps=1e-6) if gemma else Qwen3RMSNorm(D, eps=1e-6)).double()
        norm.weight.data = weight.double()
        return norm(x)
    if gemma:
        rv = Gemma4RMSNorm(D, eps=1e-6, with_scale=False)(rv)
    if {norm}:
        rq, rk = hf_norm(rq, qn_w), hf_norm(rk, kn_w)
    rq, rk = apply_rotary_pos_emb(rq.transpose(0, 1)[None], rk.transpose(0, 1)[None],
                                  cos.double()[None], sin.double()[None])
    rq, rk = rq[0].transpose(0, 1), rk[0].transpose(0, 1)
    def relerr(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    errs = [relerr(q, rq), relerr(k_cache[0, :, slots].transpose(0, 1), rk),
            relerr(v_cache[0, :, slots].transpose(0, 1), rv)]
    print("relerr", errs)
    assert q.shape == (T, H, D) and q.dtype == dtype
    assert max(errs) < {tol}, errs
    untouched = torch.ones(SLOTS, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (k_cache[0, :, untouched] == 7).all() and (v_cache[0, :, untouched] == 7).all()
""")

CASES = [
    # (tokens, heads, kv_heads, head_dim, split, bias, norm, dtype, tol, style)
    (1, 4, 2, 32, 4, False, True, "float32", 1e-6, "qwen3"),   # Qwen3 decode: GEMV partials, q/k norm
    (5, 6, 2, 64, 2, True, False, "float32", 1e-6, "qwen3"),   # bias (Qwen2-like), no q/k norm
    (3, 3, 1, 16, 0, False, False, "float16", 3e-3, "qwen3"),  # Llama: three projections, GQA 3
    (7, 4, 4, 32, 1, True, True, "float16", 3e-3, "qwen3"),
    # Gemma-4: q/k norms in fp32, weightless v norm; its full layers' V read from k_proj
    (2, 8, 2, 64, 4, False, True, "float32", 1e-6, "gemma4"),
    (3, 4, 1, 64, 2, False, True, "float32", 1e-6, "gemma4_k_eq_v"),
    (5, 8, 2, 32, 0, False, True, "float16", 3e-3, "gemma4"),
]


def _run(case, device: str):
    tokens, heads, kv_heads, head_dim, split, bias, norm, dtype, tol, style = case
    code = _CHECK.format(device=device, dtype=dtype, tokens=tokens, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, split=split, bias=bias, norm=norm, tol=tol, style=style)
    run_fresh_python(code, triton_interpret=device == "cpu")


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"t{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-s{c[4]}-{c[7]}-{c[9]}")
def test_epilogue_matches_hf_in_triton_interpreter(case):
    _run(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES[:2] + [(9, 32, 8, 128, 4, False, True, "bfloat16", 1e-2, "qwen3"),
                                              (1, 8, 1, 512, 4, False, True, "bfloat16", 1e-2, "gemma4_k_eq_v"),
                                              (4, 8, 1, 256, 4, False, True, "bfloat16", 1e-2, "gemma4")],
                         ids=lambda c: f"t{c[0]}-h{c[1]}-d{c[3]}-{c[7]}-{c[9]}")
def test_epilogue_on_cuda(case):
    _run(case, "cuda")
