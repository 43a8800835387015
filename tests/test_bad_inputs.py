"""Bad inputs: each raises the right exception type, before any work, with the offending parameter named in the
message -- and the next valid call still returns HF's tokens.

A tiny random Llama (vocab 512, word-level tokenizer "t0".."t511", see conftest) keeps this fast.  Where the
exception can come from one bad prompt among good ones, the good one comes first, so an engine that starts
work before validating everything is caught by the unchanged counters.
"""

from __future__ import annotations

import types

import pytest

from flexrollout import LLM, SamplingParams

MAX_MODEL_LEN = 64
VOCAB = 512
GOOD_IDS = [5, 17, 300, 41, 7, 99]
GOOD_TEXT = "t8 t250 t33 t401"
GOOD_TEXT_IDS = [8, 250, 33, 401]
CHECK_TOKENS = 5


def _greedy(max_tokens=CHECK_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _engine_kwargs(tok, **overrides):
    kwargs = dict(
        tokenizer=tok,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        block_size=16,
        num_gpu_blocks_override=64,  # 1024 tokens: only max_model_len limits prompt length here
        max_num_batched_tokens=256,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="module")
def engine(tiny_llama, hf_greedy, engine_stats):
    model, tok = tiny_llama()
    assert model.config.vocab_size == VOCAB
    assert tok(GOOD_TEXT).input_ids == GOOD_TEXT_IDS
    llm = LLM(model, **_engine_kwargs(tok))
    assert llm.llm_engine.model_config.max_model_len == MAX_MODEL_LEN

    def still_works():
        outs = llm.generate([GOOD_IDS, GOOD_TEXT], _greedy(), use_tqdm=False)
        assert len(outs) == 2
        for out, ids in zip(outs, (GOOD_IDS, GOOD_TEXT_IDS)):
            assert out.prompt_token_ids == ids
            assert list(out.outputs[0].token_ids) == hf_greedy(model, ids, CHECK_TOKENS).tokens

    def rejects(exc, match, call):
        """``call()`` raises ``exc`` matching ``match``, does no engine work, and the engine still works."""
        before = engine_stats(llm)
        with pytest.raises(exc, match=match):
            call()
        assert engine_stats(llm) == before, "work was done before the bad input was rejected"
        still_works()

    return types.SimpleNamespace(llm=llm, model=model, tok=tok, still_works=still_works, rejects=rejects)


BAD_PROMPTS = {
    # id: (prompts, exception, message must match)
    "empty-string": ("", ValueError, r"prompt"),
    "empty-string-in-list": ([GOOD_TEXT, ""], ValueError, r"prompt"),
    "empty-token-list": ([GOOD_IDS, []], ValueError, r"prompt"),
    "empty-prompt-token-ids": ({"prompt_token_ids": []}, ValueError, r"prompt"),
    "token-id-equal-vocab": ([GOOD_IDS, [5, VOCAB, 6]], ValueError, r"(?i)token"),
    "token-id-above-vocab": ({"prompt_token_ids": [5, VOCAB + 1000]}, ValueError, r"(?i)token"),
    "token-id-negative": ([5, -1, 6], ValueError, r"(?i)token"),
    "longer-than-max-model-len": ([GOOD_IDS, list(range(2, MAX_MODEL_LEN + 3))], ValueError, r"max_model_len"),
    "float": (3.5, TypeError, r"prompt"),
    "list-of-floats": ([1.5, 2.5], TypeError, r"prompt"),
    "float-ids-in-list": ([GOOD_IDS, [1.5, 2.5]], TypeError, r"prompt"),
    "none-in-list": ([GOOD_TEXT, None], TypeError, r"prompt"),
    "dict-without-prompt": ({"text": GOOD_TEXT}, ValueError, r"prompt"),
    "dict-without-prompt-in-list": ([{"prompt": GOOD_TEXT}, {"tokens": GOOD_IDS}], ValueError, r"prompt"),
    "multi-modal-data": (
        {"prompt": GOOD_TEXT, "multi_modal_data": {"image": None}},
        NotImplementedError,
        r"multi_modal_data",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS), ids=str)
def test_bad_prompt(engine, case):
    prompts, exc, match = BAD_PROMPTS[case]
    engine.rejects(exc, match, lambda: engine.llm.generate(prompts, _greedy(), use_tqdm=False))


def test_sampling_params_list_of_wrong_length(engine):
    sp = _greedy()
    for params in ([sp, sp, sp], [sp]):
        engine.rejects(
            ValueError, r"sampling_params", lambda: engine.llm.generate([GOOD_IDS, GOOD_TEXT], params, use_tqdm=False)
        )


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0, "max_tokens": 4}, "greedy", 0.0, [_greedy(), {"temperature": 0.0}]],
    ids=["dict", "str", "float", "list-with-dict"],
)
def test_sampling_params_of_wrong_type(engine, params):
    prompts = [GOOD_IDS, GOOD_TEXT] if isinstance(params, list) else GOOD_IDS
    engine.rejects(TypeError, r"sampling_params", lambda: engine.llm.generate(prompts, params, use_tqdm=False))


def test_unknown_sampling_params_kwarg():
    with pytest.raises(TypeError, match=r"bogus_option"):
        SamplingParams(temperature=0.0, bogus_option=1)


def test_chat_rejects_unknown_keyword(engine):
    """vLLM's chat takes no **kwargs: a misspelt option is an error, not silently dropped."""
    conversation = [{"role": "user", "content": "t5 t6"}]
    engine.rejects(TypeError, r"add_generation_promt",
                   lambda: engine.llm.chat(conversation, _greedy(), use_tqdm=False, add_generation_promt=False))


@pytest.mark.parametrize("messages", ["t5 t6", ["t5", "t6"]], ids=["bare-string", "list-of-strings"])
def test_chat_rejects_non_conversation(engine, hf_greedy, messages):
    engine.rejects(TypeError, r"messages", lambda: engine.llm.chat(messages, _greedy(), use_tqdm=False))
    outs = engine.llm.chat([{"role": "user", "content": "t5 t6"}], _greedy(), use_tqdm=False)
    assert outs[0].prompt_token_ids == [2, 5, 6, 3]
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(engine.model, [2, 5, 6, 3], CHECK_TOKENS).tokens


def test_tensor_parallel_size_2_is_rejected(tiny_llama):
    model, tok = tiny_llama()
    with pytest.raises((ValueError, NotImplementedError), match=r"tensor_parallel_size"):
        LLM(model, **_engine_kwargs(tok, tensor_parallel_size=2))


@pytest.mark.parametrize(
    "extra",
    [
        {"tensor_parallel_size": 1, "trust_remote_code": True, "enable_prefix_caching": True, "disable_log_stats": True},
        {  # what TRL's colocate mode passes besides the sizes
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.3,
            "distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": False,
            "model_impl": "vllm",
            "logprobs_mode": "processed_logprobs",
        },
    ],
    ids=["harmless-vllm-kwargs", "trl-colocate-kwargs"],
)
def test_harmless_vllm_kwargs_are_accepted(tiny_llama, hf_greedy, extra):
    model, tok = tiny_llama()
    llm = LLM(model, **_engine_kwargs(tok, **extra))
    outs = llm.generate([GOOD_IDS], _greedy(), use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(model, GOOD_IDS, CHECK_TOKENS).tokens


@pytest.mark.parametrize("options, error", [("num_warps=8", TypeError),
                                            ({"ROWS_GUARANTEED_SAFE": True}, ValueError)])
def test_bad_flex_kernel_options(tiny_llama, options, error):
    model, tok = tiny_llama()
    with pytest.raises(error, match="flex_kernel_options"):
        LLM(model, tokenizer=tok, max_model_len=64, flex_kernel_options=options)


@pytest.mark.parametrize("rows, error", [(33, ValueError), (0, ValueError), (8.0, TypeError)])
def test_bad_small_batch_max_rows(tiny_llama, rows, error):
    model, tok = tiny_llama()
    with pytest.raises(error, match="small_batch_max_rows"):
        LLM(model, tokenizer=tok, max_model_len=64, small_batch_max_rows=rows)


@pytest.mark.parametrize("rows, error", [(65, ValueError), (0, ValueError), (True, TypeError)])
def test_bad_lora_gemv_max_rows(tiny_llama, rows, error):
    model, tok = tiny_llama()
    with pytest.raises(error, match="lora_gemv_max_rows"):
        LLM(model, tokenizer=tok, max_model_len=64, lora_gemv_max_rows=rows)


@pytest.mark.parametrize("chunk, error", [(0, ValueError), (-4, ValueError), (512.0, TypeError)])
def test_bad_mlp_chunk_tokens(tiny_llama, chunk, error):
    model, tok = tiny_llama()
    with pytest.raises(error, match="mlp_chunk_tokens"):
        LLM(model, tokenizer=tok, max_model_len=64, mlp_chunk_tokens=chunk)


def test_num_kv_pages_past_int32_indexing_is_refused(tiny_llama):
    """A cache whose K/V tensor would pass 2^31 elements is refused before anything is allocated."""
    model, tok = tiny_llama()
    widest = max(model.config.num_key_value_heads * model.config.head_dim, 1)
    too_many = 2**31 // (widest * 16) + 1
    with pytest.raises(ValueError, match="num_kv_pages"):
        LLM(model, tokenizer=tok, max_model_len=64, page_size=16, num_kv_pages=too_many)


BAD_REQUEST_ARGS = {
    # id: (generate keyword arguments, exception, message must match)
    "lora-request-str": ({"lora_request": "adapter"}, TypeError, r"lora_request must be"),
    "lora-request-list-too-short": ({"lora_request": [None]}, ValueError, r"lora_request has 1 entries"),
    "lora-request-list-with-str": ({"lora_request": [None, "adapter"]}, TypeError, r"lora_request\[1\]"),
    "stop-token-id-outside-vocab": ({"sampling_params": SamplingParams(stop_token_ids=[VOCAB])},
                                    ValueError, r"stop_token_ids"),
    "allowed-token-id-outside-vocab": ({"sampling_params": SamplingParams(allowed_token_ids=[5, VOCAB])},
                                  ValueError, r"allowed_token_ids"),
    "logit-bias-outside-vocab": ({"sampling_params": SamplingParams(logit_bias={VOCAB + 3: 1.0})},
                                 ValueError, r"logit_bias"),
    "logprobs-above-vocab": ({"sampling_params": SamplingParams(logprobs=VOCAB + 1)}, ValueError, r"logprobs"),
    "prompt-logprobs-above-vocab": ({"sampling_params": SamplingParams(prompt_logprobs=VOCAB + 1)},
                                    ValueError, r"prompt_logprobs"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUEST_ARGS), ids=str)
def test_bad_request_arguments(engine, case):
    """Checked for every prompt before any work, the good prompt first."""
    kwargs, exc, match = BAD_REQUEST_ARGS[case]
    kwargs = {"sampling_params": _greedy(), **kwargs}
    engine.rejects(exc, match, lambda: engine.llm.generate([GOOD_IDS, GOOD_TEXT], use_tqdm=False, **kwargs))


def test_chat_rejects_a_bad_conversation_among_good_ones(engine):
    good = [{"role": "user", "content": "t5 t6"}]
    engine.rejects(TypeError, r"messages\[1\]",
                   lambda: engine.llm.chat([good, ["t5"]], _greedy(), use_tqdm=False))
