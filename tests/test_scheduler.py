"""Scheduler behaviour observed through the engine's counters, with HF greedy tokens as the correctness oracle.

``llm.llm_engine.stats`` counters are cumulative over the engine's life; every test compares differences.
Tiny random Llama in fp32 (see conftest) keeps these fast; EOS is ignored so lengths are exact.
"""

from __future__ import annotations

import math

import pytest

from flexrollout import SamplingParams

from conftest import random_prompts, tiny_llm


_prompts = random_prompts
_llm = tiny_llm


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _assert_hf_parity(model, outs, prompts, max_tokens, hf_greedy):
    assert len(outs) == len(prompts)
    for out, p in zip(outs, prompts):
        assert out.prompt_token_ids == p
        assert list(out.outputs[0].token_ids) == hf_greedy(model, p, max_tokens).tokens
        assert out.outputs[0].finish_reason == "length"


def test_full_batch_decodes_in_lockstep(tiny_llama, hf_greedy, engine_stats):
    """max_num_seqs=N really runs N sequences at once: N equal prompts take as many decode steps as one.

    (Regression: a reserved padding slot that eats one of the N slots serializes the N-th sequence.)
    """
    model, tok = tiny_llama()
    n, max_tokens = 4, 8
    prompts = _prompts([12] * n, seed=21)
    llm = _llm(model, tok, max_num_seqs=n)

    s0 = engine_stats(llm)
    one = llm.generate([prompts[0]], _greedy(max_tokens), use_tqdm=False)
    s1 = engine_stats(llm)
    full = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
    s2 = engine_stats(llm)

    _assert_hf_parity(model, one, prompts[:1], max_tokens, hf_greedy)
    _assert_hf_parity(model, full, prompts, max_tokens, hf_greedy)
    steps_one = s1["decode_steps"] - s0["decode_steps"]
    steps_full = s2["decode_steps"] - s1["decode_steps"]
    assert steps_one > 0
    assert steps_full == steps_one, f"{n} sequences took {steps_full} decode steps, one took {steps_one}"
    assert s2["preemptions"] == s0["preemptions"]


def test_preemption_by_recompute_keeps_hf_tokens(tiny_llama, hf_greedy, engine_stats):
    """8 pages of 16 tokens hold ~1.5 sequences of 80 tokens; 4 such sequences must preempt and still match HF."""
    model, tok = tiny_llama()
    prompt_len, max_tokens, block, pages = 20, 60, 16, 8
    full_len = prompt_len + max_tokens
    assert math.ceil(full_len / block) < pages - 1 < 2 * math.ceil(full_len / block)  # one fits, two do not
    prompts = _prompts([prompt_len] * 4, seed=31)
    llm = _llm(
        model, tok, max_model_len=128, max_num_seqs=4, block_size=block, num_gpu_blocks_override=pages
    )
    before = engine_stats(llm)
    outs = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
    after = engine_stats(llm)
    _assert_hf_parity(model, outs, prompts, max_tokens, hf_greedy)
    assert after["preemptions"] > before["preemptions"]
    # recomputation re-prefills what was evicted
    assert after["prefill_tokens"] - before["prefill_tokens"] > len(prompts) * prompt_len


def test_prompt_larger_than_cache_raises_before_work(tiny_llama, hf_greedy, engine_stats):
    """A prompt that fits max_model_len but not the whole KV cache is rejected up front."""
    model, tok = tiny_llama()
    block, pages = 16, 8  # 128 tokens of KV
    llm = _llm(model, tok, max_model_len=512, block_size=block, num_gpu_blocks_override=pages)
    ok, too_long = _prompts([10, 200], seed=41)
    assert block * pages < len(too_long) <= llm.llm_engine.model_config.max_model_len

    before = engine_stats(llm)
    with pytest.raises(ValueError, match=r"(?i)cache|page|block"):
        llm.generate([ok, too_long], _greedy(4), use_tqdm=False)
    assert engine_stats(llm) == before, "work was done before the bad prompt was rejected"

    outs = llm.generate([ok], _greedy(4), use_tqdm=False)
    _assert_hf_parity(model, outs, [ok], 4, hf_greedy)


@pytest.mark.parametrize(
    "names",
    [
        {"block_size": 32, "num_gpu_blocks_override": 5},  # vLLM's names
        {"page_size": 32, "num_kv_pages": 5},  # flexrollout's names
    ],
    ids=["vllm-names", "page-names"],
)
def test_cache_size_arguments_are_honoured(tiny_llama, hf_greedy, names):
    """5 pages of 32 tokens = 160 tokens (128 if one page is reserved for padding): a 100-token prompt runs (so
    the page size is not a default of 16), a 200-token prompt is rejected (so the page count is not a default)."""
    model, tok = tiny_llama()
    llm = _llm(model, tok, max_model_len=512, max_num_seqs=1, **names)
    fits, too_long = _prompts([100, 200], seed=51)
    with pytest.raises(ValueError):
        llm.generate([too_long], _greedy(2), use_tqdm=False)
    outs = llm.generate([fits], _greedy(8), use_tqdm=False)
    _assert_hf_parity(model, outs, [fits], 8, hf_greedy)


def test_chunked_prefill_matches_hf(tiny_llama, hf_greedy, engine_stats):
    model, tok = tiny_llama(llama3_rope=True)
    budget, prompt_len, max_tokens = 32, 100, 8
    llm = _llm(model, tok, max_model_len=256, max_num_batched_tokens=budget, num_gpu_blocks_override=32)
    (prompt,) = _prompts([prompt_len], seed=61)
    before = engine_stats(llm)
    outs = llm.generate([prompt], _greedy(max_tokens), use_tqdm=False)
    after = engine_stats(llm)
    _assert_hf_parity(model, outs, [prompt], max_tokens, hf_greedy)
    assert after["prefill_steps"] - before["prefill_steps"] >= math.ceil(prompt_len / budget)  # > 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len


def test_chunked_prefill_alongside_decodes_matches_hf(tiny_llama, hf_greedy, engine_stats):
    """Short and long prompts together under a small token budget: decodes run while the long one is chunked."""
    model, tok = tiny_llama()
    budget, max_tokens = 24, 10
    prompts = _prompts([5, 90, 7, 60], seed=71)
    llm = _llm(model, tok, max_model_len=256, max_num_batched_tokens=budget, num_gpu_blocks_override=48)
    before = engine_stats(llm)
    outs = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
    after = engine_stats(llm)
    _assert_hf_parity(model, outs, prompts, max_tokens, hf_greedy)
    assert after["prefill_steps"] - before["prefill_steps"] >= math.ceil(sum(map(len, prompts)) / budget)
