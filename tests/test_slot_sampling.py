"""Logits processors whose state lives per batch slot on the device (``SlotSampling``).

Penalty counts, the prompt mask, static bias rows (allowed_token_ids, logit_bias, one-token bad words) and
the min_tokens stop ban are written when a sequence gets its slot and updated by the step itself. These tests
attack what that can get wrong: a slot reused by a later request (nothing may be inherited), GRPO samples
forked from one prefill (each sample's counts are its own), preemption by recompute (counts rebuilt from the
tokens generated so far), batches mixing rows with and without processors, and async decode pipelining
such rows. References are HF ``generate`` (greedy; HF has repetition_penalty, min_new_tokens, bad_words_ids
and suppress_tokens) or the same requests run one at a time on an engine that never preempts or reuses a
slot mid-request (frequency / presence penalties and logit_bias have no HF equivalent; the sampling noise is
a hash of (seed, position, token), so a request's draws do not depend on its batch).
"""
from __future__ import annotations

import pytest
import torch

from flexrollout import LLM, SamplingParams
from flexrollout.bench import random_model

from conftest import random_prompts, tiny_llm

SEED_STEP = 0x9E3779B97F4A7C15      # sample i of a seeded request draws with seed + i * SEED_STEP


@torch.no_grad()
def _hf_generate(model, prompt, max_new_tokens, eos=(), **kwargs) -> list[int]:
    """HF greedy ``generate`` with logits-processor kwargs; fails on a near-tie in the processed scores."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                              pad_token_id=(list(eos) or [0])[0], output_scores=True,
                              return_dict_in_generate=True, **kwargs)
    inp = torch.tensor([list(prompt)])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=config)
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        assert float(top2[0] - top2[1]) > 1e-4, "near-tie in the HF reference; choose another prompt"
    return out.sequences[0, len(prompt):].tolist()


def _tokens(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _one_at_a_time(model, tok, prompts, params, **engine) -> list[list[int]]:
    """Each request (each sample of it, with its own seed) alone, on a fresh engine."""
    tokens = []
    for prompt, p in zip(prompts, params):
        for i in range(p.n):
            seed = None if p.seed is None else (p.seed + i * SEED_STEP) % (1 << 63)
            single = p.clone()
            single.n, single.seed = 1, seed
            llm = tiny_llm(model, tok, **engine)
            tokens += _tokens(llm.generate([{"prompt_token_ids": prompt}], single, use_tqdm=False))
    return tokens


# ------------------------------------------------------------------------------ slot reuse, mixed batches


@pytest.mark.parametrize("decode", ["async", "sync", "graphs"])
def test_mixed_rows_and_reused_slots_match_hf(peaky, decode, request):
    """Eight greedy requests through 3 slots, every other one with processors (repetition penalty, a
    one-token bad word, a suppressed token, min_tokens before a stop id): each equals HF generate with the
    same processors, and a plain request equals plain HF greedy although its slot held a processor row before
    and its batch holds processor rows now. `graphs`: async decode replaying decode graphs (on CPU through
    the `cpu_graphs` stand-in), captured as new batch sizes and processor sets turn up mid-generation."""
    model, tok = peaky
    prompts = random_prompts([9, 14, 6, 21, 11, 17, 8, 12], seed=41)
    llm = tiny_llm(model, tok, max_num_seqs=3, async_decode=decode != "sync")
    graphs = request.getfixturevalue("cpu_graphs")(llm) if decode == "graphs" else None
    params, refs = [], []
    for i, prompt in enumerate(prompts):
        plain = _hf_generate(model, prompt, 10)
        if i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
            refs.append(plain)
            continue
        # The stop id is the plain path's second token: min_tokens must hold it back.
        stop, bad, suppressed = plain[1], plain[3], plain[5]
        hf = dict(repetition_penalty=1.4, min_new_tokens=4, bad_words_ids=[[bad]], suppress_tokens=[suppressed])
        refs.append(_hf_generate(model, prompt, 10, eos=[stop], **hf))
        params.append(SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop],
                                     min_tokens=4, repetition_penalty=1.4, bad_words=[tok.decode([bad])],
                                     logit_bias={suppressed: float("-inf")}))
        assert tok(tok.decode([bad])).input_ids == [bad]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert _tokens(outs) == refs
    assert any(refs[i] != _hf_generate(model, prompts[i], 10) for i in range(0, 8, 2)), "processors never acted"
    if graphs is not None:
        assert any(key[1][3] for key in graphs.graphs), list(graphs.graphs)
    if decode != "sync":
        assert llm.llm_engine.stats.overlapped_decode_steps > 0, "processor rows should pipeline"


def test_reused_slot_inherits_nothing(peaky):
    """Two slots. X (allowed_token_ids, a strong repetition penalty, min_tokens holding back Z's greedy tokens)
    ends after 3 tokens; plain Z takes X's slot while Y, a processor row, keeps the step applying every part:
    Z reads its own row, and equals plain HF greedy. A row left from X would restrict, penalise or ban it."""
    model, tok = peaky
    x_prompt, y_prompt, z_prompt = random_prompts([24, 12, 7], seed=3)
    z_ref = _hf_generate(model, z_prompt, 8)
    y_suppressed = _hf_generate(model, y_prompt, 14)[4]
    y_ref = _hf_generate(model, y_prompt, 14, repetition_penalty=1.2, suppress_tokens=[y_suppressed])
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, allowed_token_ids=[3, 11, 200],
                             repetition_penalty=3.0, stop_token_ids=z_ref[:4], min_tokens=3),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=1.2,
                             logit_bias={y_suppressed: float("-inf")}, stop_token_ids=[1], min_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    llm = tiny_llm(model, tok, max_num_seqs=2)
    x, y, z = _tokens(llm.generate([{"prompt_token_ids": p} for p in (x_prompt, y_prompt, z_prompt)], params,
                                   use_tqdm=False))
    assert set(x) <= {3, 11, 200} and len(x) == 3
    assert y == y_ref and z == z_ref
    assert not set(z_ref) <= {3, 11, 200}


# ------------------------------------------------------------------------------ groups and preemption


PENALISED = dict(repetition_penalty=1.3, frequency_penalty=0.9, presence_penalty=0.5,
                 logit_bias={5: 1.5, 77: 0.8}, min_tokens=6, stop_token_ids=list(range(4, 500, 23)))


@pytest.mark.parametrize("async_decode", [True, False], ids=["async", "sync"])
def test_grpo_group_samples_keep_their_own_counts(peaky, async_decode):
    """n=8 samples forked from one shared prefill with strong frequency / presence penalties: each equals that
    sample run alone (its own counts). Counts shared between the group, or copied from the leader, would
    penalise tokens the sample never drew."""
    model, tok = peaky
    prompts = random_prompts([13, 19], seed=8)
    params = [SamplingParams(temperature=1.0, seed=21 + i, n=8, max_tokens=16, ignore_eos=True, **PENALISED)
              for i in range(2)]
    llm = tiny_llm(model, tok, max_num_seqs=8, async_decode=async_decode)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert got == _one_at_a_time(model, tok, prompts, params)
    assert len({tuple(t) for t in got}) > 8, "the samples should differ"
    unpenalised = [SamplingParams(temperature=1.0, seed=21 + i, n=8, max_tokens=16, ignore_eos=True)
                   for i in range(2)]
    plain = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], unpenalised, use_tqdm=False))
    assert sum(p != t for p, t in zip(plain, got)) >= 8, "the processors should change most samples"


@pytest.mark.parametrize("async_decode", [True, False], ids=["async", "sync"])
def test_preemption_rebuilds_counts_from_generated_tokens(peaky, async_decode):
    """Too few pages for four long sequences: decode preempts (recompute). A readmitted sequence's counts
    must hold exactly the tokens it generated before, in a slot that another sequence may have used since.
    Each output equals the request run alone on an engine with room to spare."""
    model, tok = peaky
    prompts = random_prompts([20, 22, 18, 25], seed=12)
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=50, ignore_eos=True, **PENALISED)
              for i in range(2)]
    params += [SamplingParams(temperature=0.8, seed=9, max_tokens=50, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, repetition_penalty=1.2)]
    llm = tiny_llm(model, tok, max_num_seqs=4, num_gpu_blocks_override=10, async_decode=async_decode)
    before = llm.llm_engine.stats.preemptions
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert llm.llm_engine.stats.preemptions > before, "the test needs preemption"
    assert got == _one_at_a_time(model, tok, prompts, params)


def test_preemption_with_repetition_penalty_matches_hf(peaky):
    """Greedy with a repetition penalty (prompt and output tokens) and min_tokens, under preemption: HF."""
    model, tok = peaky
    prompts = random_prompts([20, 22, 18, 25], seed=14)
    llm = tiny_llm(model, tok, max_num_seqs=4, num_gpu_blocks_override=10)
    params, refs = [], []
    for prompt in prompts:
        stop = _hf_generate(model, prompt, 40, repetition_penalty=1.5)[2]
        refs.append(_hf_generate(model, prompt, 40, eos=[stop], repetition_penalty=1.5, min_new_tokens=30))
        params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop],
                                     min_tokens=30, repetition_penalty=1.5))
    before = llm.llm_engine.stats.preemptions
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert llm.llm_engine.stats.preemptions > before, "the test needs preemption"
    assert got == refs


def test_sleep_drops_processor_state_and_it_comes_back(peaky):
    """sleep frees the slot state with the KV cache; after wake_up a request allocates it afresh."""
    model, tok = peaky
    prompt = random_prompts([11], seed=2)[0]
    llm = tiny_llm(model, tok, enable_sleep_mode=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5,
                            logit_bias={5: 0.5})
    first = _tokens(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
    state = llm.llm_engine.runner.slot_sampling
    assert state.counts is not None and state.bias is not None and state.stop_mask is None
    llm.sleep(level=1)
    assert state.counts is None and state.bias is None
    llm.wake_up()
    assert _tokens(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)) == first


def test_state_made_under_inference_mode_serves_calls_outside_it(peaky):
    """The first request with processors may come from a caller in torch.inference_mode (the state is then
    made of inference tensors); a later call outside it still writes its rows."""
    model, tok = peaky
    prompt = random_prompts([9], seed=1)[0]
    llm = tiny_llm(model, tok)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.5)
    ref = _hf_generate(model, prompt, 6, repetition_penalty=1.5)
    with torch.inference_mode():
        inside = _tokens(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
    outside = _tokens(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
    assert inside == outside == [ref]


# ------------------------------------------------------------------------------ GPU: replayed from graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_processor_steps_replay_from_graphs_and_match_eager():
    """Random Qwen3-0.6B in fp32: a mixed batch (penalties + logit_bias + min_tokens + multi-token
    bad-word rows, plain rows, an n=4 group), more prompts than slots. Decode replays graphs whose mode
    applies the processors, and the outputs equal an eager engine's (enforce_eager). Each processor
    request's two-token bad word is two tokens its first sample drew without bad words: the ban acts."""
    from conftest import make_tiny_tokenizer

    model = random_model("qwen3-0.6b", torch.float32, "cuda", 2048)
    vocab = model.config.vocab_size
    tok = make_tiny_tokenizer(vocab)                     # id i <-> word "t{i}", for the bad words
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 17, 64, 100, 129, 200, 5, 40)]
    processors = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                      logit_bias={7: 2.0, 11: -1.5, 13: 3.0}, min_tokens=8, stop_token_ids=list(range(2, vocab, 64)))

    def params(words):
        return [SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_tokens=24, logprobs=1, ignore_eos=True,
                               n=4 if i == 0 else 1, **({**processors, **words[i]} if i % 2 == 0 else {}))
                for i in range(len(prompts))]

    kwargs = dict(tokenizer=tok, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    graphed, eager = LLM(model, **kwargs), LLM(model, enforce_eager=True, **kwargs)
    plain = eager.generate(prompts, params([{}] * len(prompts)), use_tqdm=False)
    words = [dict(bad_words=[" ".join(f"t{t}" for t in out.outputs[0].token_ids[2:4]),
                             " ".join(f"t{t}" for t in out.outputs[0].token_ids[4:7])]) for out in plain]
    before = graphed.llm_engine.stats.overlapped_decode_steps
    a = graphed.generate(prompts, params(words), use_tqdm=False)
    b = eager.generate(prompts, params(words), use_tqdm=False)
    keys = graphed.llm_engine.runner.graphs.graphs
    assert any(key[1][3] == ("bias", "bad_words", "min_tokens", "penalties") for key in keys), list(keys)
    assert graphed.llm_engine.stats.overlapped_decode_steps > before
    for i in range(0, len(prompts), 2):
        banned, ours = plain[i].outputs[0].token_ids, a[i].outputs[0].token_ids
        assert ours[:3] == banned[:3] and ours[3] != banned[3], i       # the pair's last token, banned
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert list(cx.token_ids) == list(cy.token_ids)
            for dx, dy in zip(cx.logprobs, cy.logprobs):
                assert list(dx) == list(dy)
                for t in dx:
                    assert dx[t].logprob == pytest.approx(dy[t].logprob, abs=1e-4)


# ------------------------------------------------------------------------------ real vocabulary, HF processors


def _hf_processed(logits: torch.Tensor, seq) -> torch.Tensor:
    """One row through HF's logits processors in the engine's order (additive bias and bans, then the
    repetition penalty), then vLLM's frequency / presence penalties (no HF equivalent) as their formula."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    p, vocab = seq.params, logits.shape[-1]
    ids = torch.tensor([seq.token_ids])
    scores = logits[None].clone()
    if p.allowed_token_ids:
        others = sorted(set(range(vocab)) - set(p.allowed_token_ids))
        scores = SuppressTokensLogitsProcessor(others)(ids, scores)
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[int(t)], float(v)] for t, v in p.logit_bias.items()])(ids, scores)
    if seq.bad_words_ids:
        scores = NoBadWordsLogitsProcessor(seq.bad_words_ids)(ids, scores)
    if p.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, sorted(seq.stop_ids))(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(seq.generated_ids, dtype=torch.long), minlength=vocab).float()
    return scores[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_processed_logits_at_real_vocab_match_hf_processors():
    """151,936 ids, slots reused between two waves of sequences, five decode steps counted on the
    device: every row's processed logits equal HF's logits processors over the same history, and greedy
    draws their argmax. Covers rows without processors beside rows with each of them. The bad-words row
    is steered into both of its multi-token words (two and three tokens): each word's last token tops
    the logits right after its prefix was drawn, and is banned from the device-held history."""
    from flexrollout.engine.sampler import SlotSampling, build_sampling_tensors, process_logits, sample
    from flexrollout.engine.sequence import Sequence

    vocab, gen = 151_936, torch.Generator().manual_seed(0)
    state = SlotSampling(6, vocab, torch.device("cpu"))
    options = [dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
               dict(logit_bias={7: 3.0, 100_000: -2.0, 151_935: 5.0}, min_tokens=3),
               {},
               dict(allowed_token_ids=[5, 9, 77, 150_000], repetition_penalty=0.8),
               dict(min_tokens=4, presence_penalty=1.0)]

    @torch.inference_mode()           # as the engine's steps run
    def wave(first_slot: int, seed: int) -> None:
        seqs = []
        words = [1000 + seed, 2000 + seed, 3000 + seed, 4000 + seed, 5000 + seed]
        for i, opts in enumerate(options):
            prompt = torch.randint(0, vocab, (12,), generator=gen).tolist()
            bad = [[int(prompt[0])], words[:2], words[2:]] if i == 2 else []
            seqs.append(Sequence(seq_id=i, request_index=i, sample_index=0, token_ids=prompt, num_prompt_tokens=12,
                                 params=SamplingParams(temperature=0.0, max_tokens=8, **opts), max_tokens=8,
                                 seed=seed + i, stop_ids=frozenset({11, 151_935}), bad_words_ids=bad,
                                 slot=1 + (first_slot + i) % 5))
        state.admit(seqs)
        for step in range(5):
            logits = torch.randn(len(seqs), vocab, generator=gen) * 4
            # the second row's stop ids top its distribution: min_tokens holds them back for 3 tokens
            logits[1, [11, 151_935, 7]] = torch.tensor([40.0, 40.0, 30.0])
            logits[2, words[step]] = 40.0            # a, b (banned after a), c, d, e (banned after c d)
            st = build_sampling_tensors(seqs, vocab, state)
            processed = process_logits(logits, st.counters, *state.step_tensors(st.slots, st.processors))
            for row, seq in enumerate(seqs):
                assert torch.equal(processed[row], _hf_processed(logits[row], seq)), (step, row)
            tokens = sample(logits, st).token_ids.tolist()
            assert tokens == processed.argmax(dim=-1).tolist()
            for seq, token in zip(seqs, tokens):
                seq.token_ids.append(token)
        assert seqs[1].generated_ids[:4] == [7, 7, 7, 151_935]
        drawn = seqs[2].generated_ids
        assert drawn[0] == words[0] and drawn[1] != words[1] and drawn[2:4] == words[2:4] and drawn[4] != words[4]

    wave(0, 100)
    wave(2, 200)      # every slot reused by a sequence with other options


def test_bad_word_state_from_host_history_grows_and_is_not_inherited():
    """Multi-token bad words at the real vocabulary, held to HF's NoBadWordsLogitsProcessor over the generated
    tokens only (vLLM's rule: the prompt does not count): a sequence readmitted after a preemption bans from
    the tokens it generated before; drawn tokens extend the device history; a later sequence with more and
    longer words grows the state without changing the others' bans; a plain sequence in a slot that held
    words applies nothing."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    from flexrollout.engine.sampler import SlotSampling, build_sampling_tensors, process_logits, sample
    from flexrollout.engine.sequence import Sequence

    vocab, gen = 151_936, torch.Generator().manual_seed(1)
    state = SlotSampling(4, vocab, torch.device("cpu"))

    def seq(slot: int, prompt_end: int, generated: list[int], words: list[list[int]]) -> Sequence:
        return Sequence(seq_id=slot, request_index=slot, sample_index=0, token_ids=[3, 4, prompt_end] + generated,
                        num_prompt_tokens=3, params=SamplingParams(temperature=0.0, max_tokens=50), max_tokens=50,
                        seed=slot, stop_ids=frozenset(), bad_words_ids=words, slot=slot)

    def hf(logits_row: torch.Tensor, s: Sequence) -> torch.Tensor:
        if not s.bad_words_ids:
            return logits_row
        ids = torch.tensor([[-1] + s.generated_ids])         # -1: a placeholder no word starts with
        return NoBadWordsLogitsProcessor(s.bad_words_ids)(ids, logits_row[None].clone())[0]

    @torch.inference_mode()
    def step(seqs: list[Sequence], forced: list[int]) -> list[torch.Tensor]:
        logits = torch.randn(len(seqs), vocab, generator=gen)
        logits[range(len(seqs)), forced] = 50.0
        st = build_sampling_tensors(seqs, vocab, state)
        processed = process_logits(logits, st.counters, *state.step_tensors(st.slots, st.processors))
        for row, s in enumerate(seqs):
            assert torch.equal(processed[row], hf(logits[row], s)), (s.slot, s.generated_ids)
        for s, token in zip(seqs, sample(logits, st).token_ids.tolist()):
            s.token_ids.append(token)
        return processed

    # a: readmitted with 20 21 generated, so 22 is banned at once; b: its prompt ends in 10, which must not ban 11
    a = seq(1, 9, [5, 20, 21], [[10, 11], [20, 21, 22]])
    b = seq(2, 10, [], [[10, 11], [30, 31]])
    with torch.inference_mode():
        state.admit([a, b])
    first = step([a, b], forced=[22, 11])
    assert first[0, 22] == float("-inf") and first[1, 11] == 50.0 and b.generated_ids == [11]
    step([a, b], forced=[10, 30])                            # a draws 10, b 30: 11 and 31 banned next
    version = state.bad_words_version
    c = seq(3, 7, [], [[40 + i, 41 + i, 42, 43, 44, 45] for i in range(5)])
    with torch.inference_mode():
        state.admit([c])
    assert state.bad_words_version > version and state.bad_prefixes.shape[1:] == (8, 8)
    third = step([a, b, c], forced=[20, 31, 40])
    assert third[0, 11] == third[1, 31] == float("-inf")
    step([a, b, c], forced=[21, 8, 41])                      # a's next step would ban 22
    d = seq(1, 11, [], [])                                   # plain, in a's slot
    with torch.inference_mode():
        state.admit([d])
    step([d, b, c], forced=[22, 8, 42])
    assert d.generated_ids == [22]
