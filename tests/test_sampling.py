"""Sampling, logprobs, stop conditions, logits processing and GRPO prefix sharing.

References are always HF transformers (a teacher-forced forward or ``generate``) or plain mathematics over HF's
logits, never flexrollout's own earlier output -- except the seed-reproducibility checks, which compare two
flexrollout runs by design.

* Exact checks (logprobs, prompt logprobs, penalties, stop conditions) use SmolLM2-135M-Instruct in fp32.
* Distribution checks use a tiny random Llama whose ``lm_head`` is scaled up (x10, conftest.py's ``peaky`` fixture) so the next-token
  distribution is neither flat nor one-hot; thousands of one-token samples of one prompt share one prefill per
  group part.  Each case must pass a chi-square test (shape) and a z-test on the mean logit of the drawn tokens
  (temperature-sensitive), both at a false-alarm level below 1e-6, and asserts its own power: the same counts
  are rejected against references with a wrong temperature.
"""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch

from flexrollout import LLM, SamplingParams

# ============================================================================================ helpers

PAGE = 16
LP_TOL = 1e-4  # engine vs HF logprob tolerance (fp32, different attention code paths)

def _chat_ids(tok, content: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


@torch.no_grad()
def _hf_logits(model, ids) -> torch.Tensor:
    """(len(ids), V) fp64 logits of one teacher-forced HF forward; row i predicts token i + 1."""
    return model(torch.tensor([list(ids)])).logits[0].double()


@torch.no_grad()
def _hf_generate(model, prompt_ids, max_new_tokens, eos, **kwargs) -> list[int]:
    """HF greedy ``generate`` with extra logits-processor kwargs; fails on a near-tie in the processed scores."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos),
        pad_token_id=(list(eos) or [0])[0],
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    inp = torch.tensor([list(prompt_ids)])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        assert float(top2[0] - top2[1]) > 1e-4, "near-tie in the HF reference; choose another prompt"
    return tokens


def _tokens(out, index=0) -> list[int]:
    return list(out.outputs[index].token_ids)


def _check_logprob_entry(entry: dict, token: int, ref: torch.Tensor, k: int, tok) -> None:
    """One generated/prompt position: ``entry`` holds ``token`` plus the top-k of ``ref`` (log-probs, fp64)."""
    assert token in entry, (token, entry)
    # the chosen token: value, rank (a band absorbs ties within the tolerance) and text
    lp = entry[token]
    assert abs(lp.logprob - float(ref[token])) < LP_TOL, (lp.logprob, float(ref[token]))
    lo = 1 + int((ref > ref[token] + LP_TOL).sum())
    hi = 1 + int((ref > ref[token] - LP_TOL).sum())
    assert lo <= lp.rank <= hi, (lp.rank, lo, hi)
    assert lp.decoded_token == tok.decode([token])
    # the top-k: exactly ranks 1..k; each value is the reference value of its id AND the rank-th largest
    # reference value (so the ids are a valid top-k even with near-ties)
    ref_sorted = ref.sort(descending=True).values
    top = {t: v for t, v in entry.items() if v.rank <= k}
    assert sorted(v.rank for v in top.values()) == list(range(1, k + 1)), entry
    for t, v in top.items():
        assert abs(v.logprob - float(ref[t])) < LP_TOL
        assert abs(v.logprob - float(ref_sorted[v.rank - 1])) < LP_TOL
        assert v.decoded_token == tok.decode([t])
    assert set(entry) == set(top) | {token}


def _rep_penalize(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """HF / vLLM repetition penalty over the tokens seen so far (prompt and output)."""
    out = logits.clone()
    idx = torch.tensor(sorted(seen))
    vals = out[idx]
    out[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


# --------------------------------------------------------------------------------------------- statistics


def _chi2_critical(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a standard-normal z (z=5: p ~ 3e-7)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of integer counts against probabilities; bins expecting < 5 are pooled."""
    n = float(counts.sum())
    expected = n * probs
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] == 0:  # nothing pooled (or a truncated support): drop the empty bin unless it was hit
        assert obs[-1] == 0
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, int(obs.numel()) - 1


def _mean_z(counts: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor) -> float:
    """z-score of the draws' mean logit against its expectation under ``probs`` (a temperature-sensitive test)."""
    n = float(counts.sum())
    mean = (probs * logits).sum()
    var = (probs * (logits - mean) ** 2).sum()
    return float(((counts.double() * logits).sum() / n - mean) / (var / n).sqrt())


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> torch.Tensor:
    """vLLM's sampling distribution: softmax(logits / T), then top-k, top-p, min-p on those probabilities,
    renormalised.  Asserts no token sits within a hair of a truncation boundary (the test would be ambiguous)."""
    probs = (logits.double() / temperature).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
        assert sorted_p[top_k - 1] - sorted_p[top_k] > 1e-6
    if top_p < 1.0:
        before = sorted_p.cumsum(0) - sorted_p
        keep &= before < top_p
        assert (before - top_p).abs().min() > 1e-4
    if min_p > 0.0:
        threshold = min_p * sorted_p[0]
        keep &= sorted_p >= threshold
        assert ((sorted_p - threshold).abs() / threshold).min() > 1e-4
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


# ============================================================================================ fixtures


@pytest.fixture(scope="module")
def smol(smollm2, stop_ids):
    model, tok = smollm2
    llm = LLM(
        model,
        tokenizer=tok,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        block_size=PAGE,
        num_gpu_blocks_override=96,
        max_num_batched_tokens=48,  # the prompt-logprob prompt is longer: chunked prefill
        seed=0,
    )
    return types.SimpleNamespace(llm=llm, model=model, tok=tok, eos=stop_ids(model, tok))


def _tiny_llm(peaky, **overrides) -> LLM:
    model, tok = peaky
    kwargs = dict(tokenizer=tok, dtype="float32", max_model_len=128, max_num_seqs=8, block_size=PAGE,
                  num_gpu_blocks_override=64, max_num_batched_tokens=256, seed=0)
    kwargs.update(overrides)
    return LLM(model, **kwargs)


@pytest.fixture(scope="module")
def tiny(peaky):
    return _tiny_llm(peaky)


P1 = [17, 250, 33, 401, 8, 99, 120, 5, 61, 302]  # 10 tokens
P2 = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]  # 23 tokens
P3 = [300, 7, 7, 210]


# ============================================================================================ 1-2. logprobs


def test_sample_logprobs_match_hf_teacher_forced(smol):
    """Processed logprobs: log_softmax(penalised logits / T), before top-k/top-p; greedy reports T = 1."""
    llm, model, tok = smol.llm, smol.model, smol.tok
    prompt = tok("Here is a short story about a dragon who").input_ids
    requests = [
        SamplingParams(temperature=0.7, logprobs=3, seed=1234, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True),
        # top-k truncation must not leak into the reported logprobs; the penalty must
        SamplingParams(temperature=0.7, top_k=5, logprobs=0, seed=7, repetition_penalty=1.3, max_tokens=6,
                       ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, requests, use_tqdm=False)
    n = len(prompt)

    sampled = outs[0].outputs[0]
    gen = list(sampled.token_ids)
    assert len(gen) == 6 and len(sampled.logprobs) == 6
    logits = _hf_logits(model, prompt + gen)
    total = 0.0
    for j, token in enumerate(gen):
        ref = (logits[n - 1 + j] / 0.7).log_softmax(-1)
        _check_logprob_entry(sampled.logprobs[j], token, ref, 3, tok)
        total += float(ref[token])
    assert abs(sampled.cumulative_logprob - sum(d[t].logprob for d, t in zip(sampled.logprobs, gen))) < 1e-5
    assert abs(sampled.cumulative_logprob - total) < 6 * LP_TOL

    greedy = outs[1].outputs[0]
    gen = list(greedy.token_ids)
    logits = _hf_logits(model, prompt + gen)
    for j, token in enumerate(gen):
        raw = logits[n - 1 + j]
        assert token == int(raw.argmax())
        _check_logprob_entry(greedy.logprobs[j], token, raw.log_softmax(-1), 2, tok)
        assert greedy.logprobs[j][token].rank == 1
    assert abs(greedy.cumulative_logprob - sum(d[t].logprob for d, t in zip(greedy.logprobs, gen))) < 1e-5

    pen = outs[2].outputs[0]
    gen = list(pen.token_ids)
    logits = _hf_logits(model, prompt + gen)
    changed = False
    for j, token in enumerate(gen):
        seen = set(prompt) | set(gen[:j])
        processed = _rep_penalize(logits[n - 1 + j], seen, 1.3) / 0.7
        ref = processed.log_softmax(-1)
        assert set(pen.logprobs[j]) == {token}  # logprobs=0: only the sampled token
        _check_logprob_entry(pen.logprobs[j], token, ref, 0, tok)
        assert int((ref > ref[token]).sum()) < 5  # top_k=5 held
        changed |= abs(float(ref[token]) - float((logits[n - 1 + j] / 0.7).log_softmax(-1)[token])) > 1e-3
    assert changed, "the repetition penalty never changed a reported logprob: the check is vacuous"
    assert abs(pen.cumulative_logprob - sum(d[t].logprob for d, t in zip(pen.logprobs, gen))) < 1e-5


def test_prompt_logprobs_match_hf_teacher_forced(smol):
    """prompt_logprobs: [None, raw log_softmax of each prompt token given its prefix] (no temperature); the long
    prompt is prefilled in chunks (max_num_batched_tokens=48)."""
    llm, model, tok = smol.llm, smol.model, smol.tok
    long_prompt = tok(
        "The printing press changed how knowledge was stored and shared. Scholars could compare identical "
        "copies of a text, pamphlets spread news faster than couriers, and merchants printed tables of rates. "
        "Within fifty years presses had spread to more than two hundred cities across Europe."
    ).input_ids
    short_prompt = tok("Paris is the capital of").input_ids
    assert len(long_prompt) > 48
    outs = llm.generate(
        [{"prompt_token_ids": long_prompt}, {"prompt_token_ids": short_prompt}],
        [SamplingParams(temperature=0.7, seed=1, prompt_logprobs=2, max_tokens=1),
         SamplingParams(temperature=1.5, seed=2, prompt_logprobs=0, max_tokens=1)],
        use_tqdm=False,
    )
    for out, prompt, k in ((outs[0], long_prompt, 2), (outs[1], short_prompt, 0)):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        ref = _hf_logits(model, prompt).log_softmax(-1)
        for i in range(1, len(prompt)):
            _check_logprob_entry(plp[i], prompt[i], ref[i - 1], k, tok)
            if k == 0:
                assert set(plp[i]) == {prompt[i]}
        assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_logprobs_off_gives_none(tiny):
    out = tiny.generate([P1], SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_logprobs_minus_one_returns_whole_vocab(tiny, peaky):
    model, tok = peaky
    out = tiny.generate([P1], SamplingParams(temperature=1.0, seed=3, logprobs=-1, max_tokens=2, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    gen = list(out.token_ids)
    logits = _hf_logits(model, P1 + gen)
    vocab = model.config.vocab_size
    for j, token in enumerate(gen):
        assert len(out.logprobs[j]) == vocab
        _check_logprob_entry(out.logprobs[j], token, logits[len(P1) - 1 + j].log_softmax(-1), vocab, tok)


def test_prompt_logprobs_minus_one_returns_whole_vocab(tiny, peaky):
    model, tok = peaky
    out = tiny.generate([P1], SamplingParams(temperature=1.0, seed=3, prompt_logprobs=-1, max_tokens=1),
                        use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(P1) and out.prompt_logprobs[0] is None
    ref = _hf_logits(model, P1).log_softmax(-1)
    for i in range(1, len(P1)):
        assert len(out.prompt_logprobs[i]) == model.config.vocab_size
        _check_logprob_entry(out.prompt_logprobs[i], P1[i], ref[i - 1], model.config.vocab_size, tok)


# ============================================================================================ 3. distributions

DIST_PROMPT = list(range(20, 20 + PAGE))  # exactly one page: group members share it, no partial-page copies
DIST_SAMPLES = 8000
Z_LIMIT = 5.0  # |z| above this has probability ~6e-7 under the right distribution
DIST_CASES = {
    # name: (sampling kwargs, temperature factors whose (same-support) references the counts must reject)
    "temperature-0.5": (dict(temperature=0.5), (0.9, 1.1)),
    "temperature-1.5": (dict(temperature=1.5), (0.9, 1.1)),
    "top_k-8": (dict(temperature=1.0, top_k=8), (0.8, 1.25)),
    "top_p-0.6": (dict(temperature=0.8, top_p=0.6), (0.8, 1.25)),
    "min_p-0.1": (dict(temperature=1.2, min_p=0.1), (0.8, 1.25)),
}


@pytest.fixture(scope="module")
def distribution_counts(peaky):
    """Empirical next-token counts for every DIST_CASES entry: one generate call, n=DIST_SAMPLES per case,
    all cases in one prefix-sharing group (max_num_seqs=1024, so parts of 1024 samples per prefill)."""
    model, _ = peaky
    llm = _tiny_llm(peaky, max_num_seqs=1024, num_gpu_blocks_override=16)
    params = [SamplingParams(n=DIST_SAMPLES, max_tokens=1, seed=1000 + i, ignore_eos=True, detokenize=False, **kw)
              for i, (kw, _) in enumerate(DIST_CASES.values())]
    outs = llm.generate([{"prompt_token_ids": DIST_PROMPT}] * len(params), params, use_tqdm=False)
    vocab = model.config.vocab_size
    counts = {}
    for name, out in zip(DIST_CASES, outs):
        assert [c.index for c in out.outputs] == list(range(DIST_SAMPLES))
        assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out.outputs)
        ids = torch.tensor([c.token_ids[0] for c in out.outputs])
        counts[name] = torch.bincount(ids, minlength=vocab)
    return counts, _hf_logits(model, DIST_PROMPT)[-1]


@pytest.mark.parametrize("case", sorted(DIST_CASES))
def test_sampling_distribution_matches_reference(case, distribution_counts):
    counts, logits = distribution_counts
    kwargs, wrong_factors = DIST_CASES[case]
    count = counts[case]
    filters = {k: v for k, v in kwargs.items() if k != "temperature"}
    probs = _reference_probs(logits, kwargs["temperature"], **filters)

    outside = int(count[probs == 0].sum())
    assert outside == 0, f"{outside} draws outside the truncated support"
    stat, df = _chi2(count, probs)
    assert df >= 5, "too few bins: the test would have no power"
    assert stat < _chi2_critical(df), f"chi2={stat:.1f} df={df} vs critical {_chi2_critical(df):.1f}"
    z = _mean_z(count, probs, logits)
    assert abs(z) < Z_LIMIT, f"mean logit of the draws is {z:.1f} standard errors off"

    # the test can fail: the same counts are rejected against a wrong temperature (same support)
    for factor in wrong_factors:
        wrong = (logits.double() / (kwargs["temperature"] * factor)).softmax(-1) * (probs > 0)
        wrong = wrong / wrong.sum()
        wrong_stat, wrong_df = _chi2(count, wrong)
        rejected = wrong_stat > _chi2_critical(wrong_df) or abs(_mean_z(count, wrong, logits)) > Z_LIMIT
        assert rejected, f"no power against temperature x{factor}"
    if filters:  # truncation really cut something that the untruncated distribution would have drawn
        full = (logits.double() / kwargs["temperature"]).softmax(-1)
        assert float(full[probs == 0].sum()) * DIST_SAMPLES > 50


# ============================================================================================ 4. seeds


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny):
    sp = SamplingParams(temperature=1.0, seed=42, n=3, max_tokens=8, ignore_eos=True)
    first = tiny.generate([{"prompt_token_ids": P1}], sp, use_tqdm=False)[0]
    again = tiny.generate([{"prompt_token_ids": P1}], sp, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [_tokens(first, i) for i in range(3)]
    assert all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "the n samples of a seeded request are all identical"
    assert [_tokens(again, i) for i in range(3)] == samples

    others = [SamplingParams(temperature=0.9, n=2, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)]  # unseeded, same prompt as sp
    # seeded request in the middle of a mixed batch
    outs = tiny.generate([P2, P1, P3], [others[0], sp, others[1]], use_tqdm=False)
    assert [_tokens(outs[1], i) for i in range(3)] == samples
    # last, behind an unseeded request with the same prompt (it becomes a follower of that group)
    outs = tiny.generate([P1, P3, P2, P1], [others[2], others[1], others[0], sp], use_tqdm=False)
    assert [_tokens(outs[3], i) for i in range(3)] == samples
    assert outs[3].num_cached_tokens == len(P1)


def test_llm_seed_drives_unseeded_sampling(peaky):
    sp = SamplingParams(temperature=1.0, n=3, max_tokens=6, ignore_eos=True)
    runs = []
    for seed in (123, 123, 124):
        llm = _tiny_llm(peaky, seed=seed)
        out = llm.generate([P1, P2], sp, use_tqdm=False)
        runs.append([[_tokens(o, i) for i in range(3)] for o in out])
    assert runs[0] == runs[1], "two LLMs with the same seed= differ on unseeded requests"
    assert runs[0] != runs[2], "LLM(seed=...) has no effect on unseeded requests"
    assert len({tuple(s) for s in runs[0][0]}) > 1


# ============================================================================================ 5. stops


@pytest.fixture(scope="module")
def stop_case(smol, hf_greedy):
    """A chat prompt whose HF greedy answer ends with EOS after k tokens (k < 16)."""
    ids = _chat_ids(smol.tok, "What is the capital of France?")
    ref = hf_greedy(smol.model, ids, 16, smol.eos)
    assert ref.stopped_on_eos and 4 <= len(ref.tokens) <= 10, ref
    return ids, ref.tokens


def test_stop_strings_tokens_and_eos(smol, stop_case):
    llm, tok = smol.llm, smol.tok
    ids, ref = stop_case  # e.g. "The capital of France is Paris." + <|im_end|>
    k = len(ref)
    full_text = tok.decode(ref, skip_special_tokens=True)

    # a stop string that starts and ends inside tokens and spans several of them
    stop = full_text[5:18]
    assert stop.strip() == stop and full_text.count(stop) == 1
    cut = next(j for j in range(1, k + 1) if stop in tok.decode(ref[:j]))  # ref[cut - 1] completes it
    first = next(j for j in range(k) if len(tok.decode(ref[:j + 1])) > full_text.index(stop))  # holds stop[0]
    assert cut - first >= 3, "the stop string should span at least three tokens"
    boundaries = {len(tok.decode(ref[:j])) for j in range(k + 1)}
    start = full_text.index(stop)
    assert start not in boundaries and start + len(stop) not in boundaries, "should start and end mid-token"

    stop_id_pos = 3
    stop_id = ref[stop_id_pos]
    assert ref.index(stop_id) == stop_id_pos and stop_id not in smol.eos

    base = dict(temperature=0.0, max_tokens=16)
    params = [
        SamplingParams(**base),
        SamplingParams(stop=["never appears here", stop], **base),
        SamplingParams(stop=stop, include_stop_str_in_output=True, **base),
        SamplingParams(stop_token_ids=[stop_id], **base),
        SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True, **base),
    ]
    outs = llm.generate([{"prompt_token_ids": ids}] * len(params), params, use_tqdm=False)
    plain, s1, s2, t1, t2 = (o.outputs[0] for o in outs)

    assert list(plain.token_ids) == ref
    assert plain.finish_reason == "stop" and plain.stop_reason is None  # EOS
    assert plain.text == full_text

    for comp, include in ((s1, False), (s2, True)):
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert list(comp.token_ids) == ref[:cut]
        end = full_text.index(stop) + (len(stop) if include else 0)
        assert comp.text == full_text[:end]

    for comp, include in ((t1, False), (t2, True)):
        assert comp.finish_reason == "stop" and comp.stop_reason == stop_id
        assert list(comp.token_ids) == ref[:stop_id_pos + 1]
        assert comp.text == tok.decode(ref[:stop_id_pos + (1 if include else 0)])


def test_min_tokens_and_ignore_eos(smol, stop_case, hf_greedy):
    llm, tok, model = smol.llm, smol.tok, smol.model
    ids, ref = stop_case
    k = len(ref)
    min_tokens, max_tokens = k + 5, k + 8
    ref_min = _hf_generate(model, ids, max_tokens, smol.eos, min_new_tokens=min_tokens)
    ref_ignore = hf_greedy(model, ids, k + 3).tokens  # EOS disabled
    assert ref_ignore[:k] == ref and len(ref_ignore) == k + 3

    outs = llm.generate(
        [{"prompt_token_ids": ids}] * 2,
        [SamplingParams(temperature=0.0, min_tokens=min_tokens, max_tokens=max_tokens),
         SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=k + 3, skip_special_tokens=False)],
        use_tqdm=False,
    )
    held, ignored = outs[0].outputs[0], outs[1].outputs[0]
    assert list(held.token_ids) == ref_min
    assert len(held.token_ids) >= min_tokens > k
    assert not set(held.token_ids[:min_tokens]) & set(smol.eos)
    assert list(held.token_ids[: k - 1]) == ref[: k - 1]
    assert held.finish_reason == ("stop" if len(ref_min) < max_tokens else "length")

    assert list(ignored.token_ids) == ref_ignore and ignored.token_ids[k - 1] in smol.eos
    assert ignored.finish_reason == "length" and ignored.stop_reason is None
    assert ignored.text == tok.decode(ref_ignore, skip_special_tokens=False)
    assert "<|im_end|>" in ignored.text


@pytest.mark.parametrize("streamed", [True, False], ids=["DecodeStream", "slow-tokenizer-offsets"])
def test_incremental_text_matches_the_tokenizers_decode(smol, streamed):
    """Stop strings are searched in text decoded token by token; that text must be the
    tokenizer's own decode of the output continuing the prompt, multi-byte characters split
    across byte-level tokens included (a partial character is held back, never emitted)."""
    from flexrollout.engine import detokenizer
    from flexrollout.engine.sequence import Sequence

    tok = smol.tok
    prompt = tok("Say it:", add_special_tokens=False).input_ids
    output = tok(" héllo wörld 🙂 日本語 done", add_special_tokens=False).input_ids
    seq = Sequence(seq_id=0, request_index=0, sample_index=0, token_ids=list(prompt),
                   num_prompt_tokens=len(prompt), params=SamplingParams(stop=["never"]), max_tokens=64, seed=0)
    append = (functools.partial(detokenizer._append_streamed, tok.backend_tokenizer) if streamed
              else functools.partial(detokenizer._append_by_offsets, tok))
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        pieces.append(append(seq))
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert "".join(pieces) == seq.text == expected
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces                     # some token ended inside a character and was held back


# ============================================================================================ 6-7. processing


@pytest.mark.parametrize("text", ["1, 2, 1, 2, 1, 2, 1, 2,", "The cat sat on the mat. The cat sat on the"])
def test_repetition_penalty_matches_hf_generate(smol, text):
    llm, tok, model = smol.llm, smol.tok, smol.model
    ids = tok(text).input_ids
    ref = _hf_generate(model, ids, 10, smol.eos, repetition_penalty=1.3)
    # the penalty matters on this path: the unpenalised argmax differs somewhere
    logits = _hf_logits(model, ids + ref)
    assert any(int(logits[len(ids) - 1 + j].argmax()) != t for j, t in enumerate(ref))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                                                 max_tokens=10), use_tqdm=False)[0]
    assert _tokens(out) == ref


def test_presence_frequency_penalty_and_logit_bias_match_reference(smol):
    """Greedy with presence/frequency penalties (over generated tokens) and a logit bias: each step's token is the
    argmax of HF's logits + bias - freq * count - presence * [count > 0], and its logprob the log_softmax of it."""
    llm, tok, model = smol.llm, smol.tok, smol.model
    ids = tok("1, 2, 1, 2, 1, 2, 1, 2,").input_ids
    newline = tok("\n").input_ids[-1]
    bias = {newline: 2.0}
    pres, freq = 0.7, 0.5
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, presence_penalty=pres, frequency_penalty=freq, logit_bias=bias, logprobs=1,
        max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    gen = list(out.token_ids)
    assert len(gen) == 10
    logits = _hf_logits(model, ids + gen)
    differs = False
    for j, token in enumerate(gen):
        raw = logits[len(ids) - 1 + j]
        processed = raw.clone()
        processed[newline] += bias[newline]
        counts = torch.bincount(torch.tensor(gen[:j], dtype=torch.long), minlength=raw.numel()).double()
        processed -= freq * counts + pres * (counts > 0).double()
        top2 = processed.topk(2).values
        assert float(top2[0] - top2[1]) > 1e-4, "near-tie in the reference"
        assert token == int(processed.argmax()), f"step {j}"
        _check_logprob_entry(out.logprobs[j], token, processed.log_softmax(-1), 1, tok)
        differs |= token != int(raw.argmax())
    assert differs, "penalties and bias never changed the greedy token: the check is vacuous"


def test_logit_bias_forces_and_bans(tiny, peaky, hf_greedy):
    model, _ = peaky
    forced = 77
    assert forced not in hf_greedy(model, P1, 6).tokens
    out = tiny.generate([P1], SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=6, ignore_eos=True,
                                             logit_bias={forced: 100.0}), use_tqdm=False)[0]
    for comp in out.outputs:
        assert list(comp.token_ids) == [forced] * 6
    # -inf bias bans the greedy token: the result is HF greedy with that token suppressed
    greedy = hf_greedy(model, P1, 6).tokens
    banned = greedy[0]
    ref = _hf_generate(model, P1, 6, [], suppress_tokens=[banned])
    out = tiny.generate([P1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                             logit_bias={banned: float("-inf")}), use_tqdm=False)[0]
    assert _tokens(out) == ref and banned not in ref


def test_allowed_token_ids_restrict_samples(tiny, peaky):
    model, _ = peaky
    allowed = [3, 11, 200, 333, 480]
    out = tiny.generate([P1, P2], SamplingParams(temperature=1.5, seed=9, n=6, max_tokens=6, ignore_eos=True,
                                                 allowed_token_ids=allowed), use_tqdm=False)
    drawn = [t for o in out for c in o.outputs for t in c.token_ids]
    assert len(drawn) == 2 * 6 * 6
    assert set(drawn) <= set(allowed)
    assert len(set(drawn)) >= 3, "allowed tokens should all be reachable at T=1.5"
    # greedy over the allowed set is the argmax of HF's logits restricted to it
    out = tiny.generate([P1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                             allowed_token_ids=allowed), use_tqdm=False)[0]
    gen = _tokens(out)
    logits = _hf_logits(model, P1 + gen)
    for j, token in enumerate(gen):
        row = logits[len(P1) - 1 + j]
        assert token == allowed[int(row[allowed].argmax())]


def test_bad_words_match_hf_and_never_appear(tiny, peaky, hf_greedy):
    """bad_words: a one-token word is never generated; a two-token word's last token is banned right after its
    first.  Greedy output equals HF ``generate(bad_words_ids=...)``."""
    model, tok = peaky
    single = hf_greedy(model, P2, 12).tokens[2]
    ref_single = _hf_generate(model, P2, 12, [], bad_words_ids=[[single]])
    # a two-token bad word taken from the path that avoids `single`; its first token is not the prompt's last one
    j = next(j for j in range(len(ref_single) - 1) if ref_single[j] != P2[-1])
    pair = ref_single[j:j + 2]
    words = [tok.decode([single]), tok.decode(pair)]
    assert tok(words[0]).input_ids == [single] and tok(words[1]).input_ids == pair

    ref = _hf_generate(model, P2, 12, [], bad_words_ids=[[single], pair])
    assert ref[:j + 1] == ref_single[:j + 1] and ref[j + 1] != pair[1]  # the pair ban really acted
    out = tiny.generate([{"prompt_token_ids": P2}], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=words), use_tqdm=False)[0]
    gen = _tokens(out)
    assert gen == ref
    assert single not in gen and all(gen[i:i + 2] != pair for i in range(len(gen) - 1))

    # sampled too: many draws, never a bad word
    out = tiny.generate([{"prompt_token_ids": P2}], SamplingParams(
        temperature=1.0, seed=4, n=8, max_tokens=8, ignore_eos=True, bad_words=words), use_tqdm=False)[0]
    for comp in out.outputs:
        g = list(comp.token_ids)
        assert single not in g and all(g[i:i + 2] != pair for i in range(len(g) - 1))


def test_truncate_prompt_tokens_keeps_the_tail(tiny, peaky, hf_greedy):
    model, _ = peaky
    out = tiny.generate([{"prompt_token_ids": P2}], SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=7), use_tqdm=False)[0]
    assert out.prompt_token_ids == P2[-7:]
    assert _tokens(out) == hf_greedy(model, P2[-7:], 5).tokens


# ============================================================================================ 8. prefix sharing


@torch.no_grad()
def _check_seeded_draws(model, prompt, tokens, seed: int, temperature: float = 1.0) -> None:
    """Each token a seeded request drew is the Gumbel-max of HF's teacher-forced next-token logits
    / T with the sampler's documented noise, a pure function of (seed, position, token id); by
    induction the whole path is HF's. Fails on a near-tie, where engine-vs-HF rounding decides."""
    from flexrollout.engine.sampler import gumbel_noise

    ids = list(prompt) + list(tokens)
    logits = model(torch.tensor([ids])).logits[0].float() / temperature
    positions = torch.arange(len(prompt), len(ids))
    noise = gumbel_noise(torch.full_like(positions, seed), positions, logits.shape[-1])
    top2 = (logits[positions - 1] + noise).topk(2)
    assert top2.indices[:, 0].tolist() == list(tokens)
    assert (top2.values[:, 0] - top2.values[:, 1]).min() > 1e-4, "near-tie: choose another seed"


@pytest.mark.parametrize("prompt_len", [21, 32])  # partial last page copied / page-aligned prompt
def test_group_shares_prefill_and_pages(peaky, hf_greedy, engine_stats, prompt_len):
    model, _ = peaky
    llm = _tiny_llm(peaky)
    prompt = [(7 * i + 3) % 500 + 2 for i in range(prompt_len)]
    seeds = [11, 22, 33, 44]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in seeds]

    reference, sep_pages, sep_prefill = [], 0, 0
    for sp in params:
        before = engine_stats(llm)
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        after = engine_stats(llm)
        _check_seeded_draws(model, prompt, _tokens(out), sp.seed)
        reference.append(_tokens(out))
        assert out.num_cached_tokens == 0
        sep_pages += after["pages_allocated"] - before["pages_allocated"]
        sep_prefill += after["prefill_tokens"] - before["prefill_tokens"]
    assert sep_prefill == 4 * prompt_len
    assert len({tuple(t) for t in reference}) == 4

    before = engine_stats(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    after = engine_stats(llm)
    assert [_tokens(o) for o in outs] == reference
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len
    grouped_pages = after["pages_allocated"] - before["pages_allocated"]
    assert grouped_pages < sep_pages
    assert grouped_pages == sep_pages - 3 * (prompt_len // PAGE)  # followers reference the full pages
    assert [o.num_cached_tokens for o in outs] == [0, prompt_len, prompt_len, prompt_len]

    # n=4 in one request: one prefill; the request reports the followers' reuse
    before = engine_stats(llm)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=1.0, seed=5, n=4, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    after = engine_stats(llm)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt_len
    assert out.num_cached_tokens == prompt_len
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1

    # greedy group: every member (leader and followers reading shared/copied pages) equals HF
    ref = hf_greedy(model, prompt, 8).tokens
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, SamplingParams(temperature=0.0, max_tokens=8,
                                                                           ignore_eos=True), use_tqdm=False)
    assert [_tokens(o) for o in outs] == [ref] * 3

    # prefix caching off, or a request that skips reading shared KV: no sharing, same tokens
    plain = _tiny_llm(peaky, enable_prefix_caching=False)
    skipping = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True,
                               skip_reading_prefix_cache=True) for s in seeds]
    for engine, request_params in ((plain, params), (llm, skipping)):
        before = engine_stats(engine)
        outs = engine.generate([{"prompt_token_ids": prompt}] * 4, request_params, use_tqdm=False)
        after = engine_stats(engine)
        assert [_tokens(o) for o in outs] == reference
        assert after["prefill_tokens"] - before["prefill_tokens"] == 4 * prompt_len
        assert after["pages_allocated"] - before["pages_allocated"] == sep_pages
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]


# ============================================================================================ 9. bad values


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=-2), ValueError, "top_k"),
        (dict(min_p=1.5), ValueError, "min_p"),
        (dict(n=0), ValueError, "n"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
        (dict(presence_penalty=3.0), ValueError, "presence_penalty"),
        (dict(logprobs=-2), ValueError, "logprobs"),
        (dict(temperature=0.0, n=2), ValueError, "n"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


def test_structured_outputs_not_implemented():
    from flexrollout.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    with pytest.raises(NotImplementedError, match="structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(NotImplementedError, match="guided_decoding"):
        SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_vocab_raise_and_engine_stays_usable(peaky, hf_greedy, field):
    model, _ = peaky
    llm = _tiny_llm(peaky)  # its own engine: the failure must not leak into other tests
    with pytest.raises(ValueError, match=field):
        llm.generate([P1], SamplingParams(temperature=1.0, seed=1, max_tokens=2, **{field: 600}), use_tqdm=False)
    out = llm.generate([P1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert _tokens(out) == hf_greedy(model, P1, 4).tokens


def test_failure_inside_a_step_leaves_no_stale_work(peaky, hf_greedy, engine_stats, monkeypatch):
    model, _ = peaky
    llm = _tiny_llm(peaky)
    runner = llm.llm_engine.runner

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "prefill", boom)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([P2, P3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    before = engine_stats(llm)
    out = llm.generate([P1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    after = engine_stats(llm)
    assert _tokens(out) == hf_greedy(model, P1, 4).tokens
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(P1), "the failed call's prompts were prefilled"
    assert after["decode_steps"] - before["decode_steps"] == 3


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(stop_token_ids=[5, 512]), "stop_token_ids"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
        (dict(allowed_token_ids=[3, 512]), "allowed_token_ids"),
        (dict(logit_bias={700: 1.0}), "logit_bias"),
    ],
)
def test_out_of_vocab_ids_raise_at_generate(tiny, peaky, hf_greedy, engine_stats, kwargs, name):
    model, _ = peaky
    assert model.config.vocab_size == 512
    before = engine_stats(tiny)
    with pytest.raises(ValueError, match=name):
        tiny.generate([P1, P2], [SamplingParams(temperature=0.0, max_tokens=3),
                                 SamplingParams(temperature=0.0, max_tokens=3, **kwargs)], use_tqdm=False)
    assert engine_stats(tiny) == before, "work was done before the bad request was rejected"
    out = tiny.generate([P1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert _tokens(out) == hf_greedy(model, P1, 4).tokens


def test_packed_sampling_rows_round_trip():
    """The one-copy packing of per-row settings (used on CUDA) returns every value bit-exactly:
    negative and tiny floats, and seeds above 2^62."""
    from flexrollout.engine.sampler import float_bits, pack_rows, unpack_row

    floats = torch.tensor([0.0, -1.5, 1e-30, 3.4e38, 0.7], dtype=torch.float32)
    ints = torch.tensor([0, -1, 2**62 + 12345, 7, 2**63 - 1], dtype=torch.int64)
    packed = pack_rows([floats, ints])
    assert torch.equal(unpack_row(packed[0], torch.float32), floats)
    assert torch.equal(unpack_row(packed[1], torch.int64), ints)
    # A graph input reads the low 32 bits of each int64 cell as float32 (little-endian).
    assert torch.equal(float_bits(floats).view(torch.float32)[::2], floats)
