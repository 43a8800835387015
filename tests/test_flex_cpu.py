"""The flex_attention path on CPU, against HF greedy.

Off CUDA, `attention_backend="flex"` runs flex_attention's own unfused implementation over
everything the engine builds for its fused kernels: the packed-prefill and decode block masks
from the page table, the decode layout (each KV head's GQA group folded into the query axis),
sliding windows, shared KV, sinks and per-layer head dims. CI otherwise runs the reference
backend, and the GPU tests run flex's fused kernels; this covers the engine's side of flex in CI.
(flex's unfused implementation evaluates the mask function everywhere, so which pages a block
mask lists is left to the GPU tests.)
"""
from __future__ import annotations

import pytest
from conftest import make_tiny_model, make_tiny_moe, tiny_llm

from flexrollout import SamplingParams

MAX_TOKENS = 8


def _model(case: str):
    if case == "llama":
        return make_tiny_model("llama", seed=4, layers=2)
    if case == "gpt_oss":                    # sliding window 6 on even layers, attention sinks
        return make_tiny_moe("gpt_oss")
    if case.startswith("gemma4"):            # windows of 6, head dims 16 / 32, shared KV, k_eq_v
        from test_gemma4 import make_tiny_gemma4
        return make_tiny_gemma4(case.split("-")[1])
    # Qwen3.5: gated full attention beside GatedDeltaNet
    from test_qwen35 import make_tiny_qwen35
    return make_tiny_qwen35(case.split("-")[1])


@pytest.mark.parametrize("case", ["llama", "gpt_oss", "gemma4-dense", "gemma4-e2b", "gemma4-moe", "qwen35-dense"])
def test_flex_backend_greedy_matches_hf(case, hf_greedy):
    """Prompts of 3 to 40 tokens (past every window, over 3 pages of 16) in one batch, and a
    group of two samples of one prompt (prefilled once, then forked)."""
    model, tok = _model(case)
    llm = tiny_llm(model, tok, attention_backend="flex")
    vocab = model.config.get_text_config().vocab_size
    prompts = [[(7 * i + 3 * b + 2) % (vocab - 2) + 2 for i in range(n)] for b, n in enumerate((3, 9, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [hf_greedy(model, p, MAX_TOKENS).tokens for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    # top_k=1: sampling that picks HF's greedy token (greedy itself takes only n=1, as in vLLM)
    group = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(
        n=2, temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in group[0].outputs] == [expected[2]] * 2
