"""Greedy token parity with HF ``model.generate(do_sample=False)`` in fp32 on CPU.

References are computed one prompt at a time without padding, so they are exact; the engine runs all prompts
of a test in one batched call.  Parity is always against HF, never against flexrollout's own earlier output.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from flexrollout import LLM, SamplingParams

from conftest import random_prompts, tiny_llm

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined several existing technologies into a single system for producing books. Movable type "
    "had been used in East Asia for centuries, but Gutenberg's alloy of lead, tin and antimony, his adjustable "
    "hand mould and his oil-based ink made it practical to print large runs quickly and cheaply. Within fifty "
    "years, presses had spread to more than two hundred cities across Europe, and millions of volumes had been "
    "printed. The consequences were enormous. Scholars could compare identical copies of a text, which made "
    "errors easier to find and correct. Vernacular languages gained standard spellings as printers chose one "
    "form over another. Pamphlets carried news and arguments faster than any courier, feeding religious reform "
    "and political debate. Merchants used printed tables of exchange rates and tide times, and universities "
    "built libraries that would have been unthinkable a century earlier. Historians still argue about how "
    "quickly literacy rose, since books remained expensive for most families well into the seventeenth "
    "century, but few doubt that the press changed how knowledge was stored, shared and challenged. Later "
    "centuries brought steam-powered presses, rotary presses and finally offset lithography, each of which "
    "lowered the cost of a printed page again. In the following summary, the three most important effects of "
    "the printing press are listed:"
)

RAW_PROMPTS = [
    "The sky is",  # 3 tokens
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time",
    LONG_TEXT,  # ~300 tokens: prefilled in chunks under max_num_batched_tokens=128
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "Summarize in one sentence: " + LONG_TEXT[:700]}],
]

SMOL_MAX_TOKENS = 24
SMOL_MAX_NUM_SEQS = 3  # fewer than the 8 prompts: requests must queue
SMOL_BATCHED_TOKENS = 128  # smaller than the long prompt: chunked prefill


def _chat_ids(tok, conversation):
    return tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def _module_forward_untouched(model):
    """Names of modules whose ``forward`` was replaced (instance attribute, or not the class's function)."""
    bad = []
    for name, m in model.named_modules():
        if "forward" in m.__dict__:
            bad.append(name)
            continue
        bound = m.forward
        if getattr(bound, "__func__", None) is not type(m).forward:
            bad.append(name)
    return bad


def _assert_model_untouched(model, before_fingerprint, probe_ids, logits_before, fingerprint):
    after = fingerprint(model)
    changed_tensors = [k for k in before_fingerprint["tensors"] if before_fingerprint["tensors"][k] != after["tensors"].get(k)]
    assert not changed_tensors, f"parameters/buffers changed (identity, dtype, requires_grad or values): {changed_tensors[:5]}"
    assert set(after["tensors"]) == set(before_fingerprint["tensors"]), "parameters or buffers added/removed"
    changed_modules = [k for k in before_fingerprint["modules"] if before_fingerprint["modules"][k] != after["modules"].get(k)]
    assert not changed_modules, f"modules changed (type, forward, hooks or training flag): {changed_modules[:5]}"
    assert set(after["modules"]) == set(before_fingerprint["modules"]), "modules added/removed"
    assert not _module_forward_untouched(model)
    with torch.no_grad():
        logits_after = model(torch.tensor([probe_ids])).logits
    assert torch.equal(logits_after, logits_before), "the model's own HF forward output changed"


# ============================================================================================ SmolLM2


@pytest.fixture(scope="module")
def smol(smollm2, model_fingerprint):
    model, tok = smollm2
    probe_ids = tok("The quick brown fox jumps over the lazy dog.").input_ids
    with torch.no_grad():
        logits_before = model(torch.tensor([probe_ids])).logits.clone()
    fingerprint_before = model_fingerprint(model)
    assert not _module_forward_untouched(model)
    llm = LLM(
        model,
        tokenizer=tok,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=SMOL_MAX_NUM_SEQS,
        block_size=16,
        num_gpu_blocks_override=96,
        max_num_batched_tokens=SMOL_BATCHED_TOKENS,
        seed=0,
    )
    return types.SimpleNamespace(
        llm=llm,
        model=model,
        tok=tok,
        probe_ids=probe_ids,
        logits_before=logits_before,
        fingerprint_before=fingerprint_before,
    )


def _check_output(out, prompt_ids, ref, tok, max_tokens):
    assert out.prompt_token_ids == prompt_ids
    assert len(out.outputs) == 1
    comp = out.outputs[0]
    assert comp.index == 0
    assert list(comp.token_ids) == ref.tokens
    if len(ref.tokens) < max_tokens:
        assert ref.stopped_on_eos
        assert comp.finish_reason == "stop"
    elif not ref.stopped_on_eos:
        assert comp.finish_reason == "length"
    else:  # EOS exactly at max_tokens: vLLM versions differ on which reason wins
        assert comp.finish_reason in ("stop", "length")
    assert comp.text == tok.decode(ref.tokens, skip_special_tokens=True)
    assert out.finished


def test_smollm2_batched_greedy_parity(smol, hf_greedy, stop_ids, engine_stats):
    tok, model, llm = smol.tok, smol.model, smol.llm
    chat_texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHAT_CONVERSATIONS]
    # interleave raw and chat prompts so short and long ones share the batch
    prompts = [p for pair in zip(RAW_PROMPTS, chat_texts) for p in pair]
    prompt_ids = [tok(p).input_ids for p in prompts]
    lengths = [len(ids) for ids in prompt_ids]
    assert min(lengths) <= 4 and max(lengths) > 2 * SMOL_BATCHED_TOKENS, lengths
    assert max(lengths) + SMOL_MAX_TOKENS <= llm.llm_engine.model_config.max_model_len

    eos = stop_ids(model, tok)
    refs = [hf_greedy(model, ids, SMOL_MAX_TOKENS, eos) for ids in prompt_ids]
    assert any(r.stopped_on_eos for r in refs) and any(not r.stopped_on_eos for r in refs)

    before = engine_stats(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=SMOL_MAX_TOKENS), use_tqdm=False)
    after = engine_stats(llm)

    assert len(outs) == len(prompts)
    for i, (out, ids, ref) in enumerate(zip(outs, prompt_ids, refs)):
        assert out.prompt == prompts[i]
        _check_output(out, ids, ref, tok, SMOL_MAX_TOKENS)

    # the long prompt alone needs ceil(len / budget) prefill chunks
    assert after["prefill_steps"] - before["prefill_steps"] >= math.ceil(max(lengths) / SMOL_BATCHED_TOKENS)
    assert after["decode_steps"] > before["decode_steps"]


def test_smollm2_chat_equals_generate_on_templated_ids(smol, hf_greedy, stop_ids):
    tok, model, llm = smol.tok, smol.model, smol.llm
    conversations = [CHAT_CONVERSATIONS[0], CHAT_CONVERSATIONS[2]]
    ids = [_chat_ids(tok, c) for c in conversations]
    for c, i in zip(conversations, ids):  # the text route tokenizes to the same ids
        assert tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)).input_ids == i
    eos = stop_ids(model, tok)
    refs = [hf_greedy(model, i, SMOL_MAX_TOKENS, eos) for i in ids]
    sp = SamplingParams(temperature=0, max_tokens=SMOL_MAX_TOKENS)

    chat_outs = llm.chat(conversations, sp, use_tqdm=False)  # a list of conversations
    assert len(chat_outs) == 2
    for out, i, ref in zip(chat_outs, ids, refs):
        _check_output(out, i, ref, tok, SMOL_MAX_TOKENS)

    single = llm.chat(conversations[0], sp, use_tqdm=False)  # one conversation
    assert len(single) == 1
    _check_output(single[0], ids[0], refs[0], tok, SMOL_MAX_TOKENS)

    gen = llm.generate({"prompt_token_ids": ids[1]}, sp, use_tqdm=False)
    assert len(gen) == 1
    _check_output(gen[0], ids[1], refs[1], tok, SMOL_MAX_TOKENS)
    assert list(gen[0].outputs[0].token_ids) == list(chat_outs[1].outputs[0].token_ids)


def test_smollm2_engine_leaves_model_untouched(smol, model_fingerprint):
    outs = smol.llm.generate(
        {"prompt_token_ids": smol.probe_ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert len(outs[0].outputs[0].token_ids) >= 1
    _assert_model_untouched(
        smol.model, smol.fingerprint_before, smol.probe_ids, smol.logits_before, model_fingerprint
    )


# ============================================================================================ tiny models

TINY_MAX_TOKENS = 12


def _tiny_prompts(seed=8, lengths=(7, 16, 30, 1)):
    return random_prompts(lengths, seed)


def _tiny_llm(model, tok, **overrides):
    return tiny_llm(model, tok, **{"num_gpu_blocks_override": 32, **overrides})


def test_tiny_variant_parity(tiny_model, hf_greedy):
    """Llama / Qwen3: tied and untied, attention bias, llama3 rope, GQA 3; token-id prompts in one call."""
    model, tok = tiny_model
    prompts = _tiny_prompts()
    prompts.append(list(prompts[1]))  # a repeated prompt (GRPO groups); 5 prompts > max_num_seqs
    refs = [hf_greedy(model, p, TINY_MAX_TOKENS) for p in prompts]  # (asserts no near-ties)

    llm = _tiny_llm(model, tok)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=TINY_MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    assert len(outs) == len(prompts)
    for out, p, ref in zip(outs, prompts, refs):
        assert out.prompt_token_ids == p
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref.tokens
        assert comp.finish_reason == "length"
        assert comp.text == tok.decode(ref.tokens, skip_special_tokens=True)


def test_tiny_prefill_mlp_in_row_chunks_matches_hf(tiny_llama, hf_greedy):
    """mlp_chunk_tokens=5: every prefill's o_proj + MLP runs in 5-row chunks (the last one partial)."""
    model, tok = tiny_llama(attention_bias=True)
    prompts = _tiny_prompts(seed=9)
    refs = [hf_greedy(model, p, TINY_MAX_TOKENS) for p in prompts]
    llm = _tiny_llm(model, tok, mlp_chunk_tokens=5)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=TINY_MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == [ref.tokens for ref in refs]


def test_tiny_engine_leaves_model_untouched(tiny_model, model_fingerprint):
    model, tok = tiny_model
    probe_ids = _tiny_prompts(seed=5, lengths=(9,))[0]
    with torch.no_grad():
        logits_before = model(torch.tensor([probe_ids])).logits.clone()
    before = model_fingerprint(model)
    llm = _tiny_llm(model, tok)
    llm.generate([probe_ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    _assert_model_untouched(model, before, probe_ids, logits_before, model_fingerprint)


def test_prompt_formats(tiny_llama, hf_greedy):
    """Every prompt form vLLM accepts gives HF's tokens and the right prompt_token_ids, in input order."""
    model, tok = tiny_llama()
    a, b, c = _tiny_prompts(seed=11, lengths=(5, 9, 13))
    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    assert tok(text(a)).input_ids == a
    n = 6
    ref = {tuple(p): hf_greedy(model, p, n).tokens for p in (a, b, c)}
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm = _tiny_llm(model, tok)

    cases = [
        (text(a), [a]),
        ([text(a), text(b), text(c)], [a, b, c]),
        (list(b), [b]),
        ([c, a, b], [c, a, b]),
        ({"prompt_token_ids": c}, [c]),
        ({"prompt": text(b)}, [b]),
        ([{"prompt_token_ids": b}, {"prompt": text(c)}, {"prompt_token_ids": a}], [b, c, a]),
    ]
    for prompts, expected in cases:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == expected, prompts
        assert [list(o.outputs[0].token_ids) for o in outs] == [ref[tuple(e)] for e in expected], prompts


def test_tiny_chat_uses_chat_template(tiny_llama, hf_greedy):
    model, tok = tiny_llama()
    conversation = [{"role": "user", "content": "t5 t17 t300 t41"}]
    ids = _chat_ids(tok, conversation)
    assert ids == [2, 5, 17, 300, 41, 3]
    ref = hf_greedy(model, ids, 6)
    llm = _tiny_llm(model, tok)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.chat(conversation, sp, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids
    assert list(outs[0].outputs[0].token_ids) == ref.tokens
    outs = llm.chat([conversation, [{"role": "user", "content": "t9"}]], sp, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids, [2, 9, 3]]
    assert list(outs[1].outputs[0].token_ids) == hf_greedy(model, [2, 9, 3], 6).tokens
