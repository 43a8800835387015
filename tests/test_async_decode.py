"""Async decode (step t+1 launched before step t's tokens are read back) against the synchronous loop.

Every test runs the same requests through two engines over the same model, ``async_decode=True`` and
``False``, and asserts identical outputs, plus that the async engine really overlapped steps
(``stats.overlapped_decode_steps``) where it should. Stop ids and strings never come from either
engine's output: greedy cases take them from HF's greedy path (and expect HF's path cut at the stop);
sampled cases stop on a fixed set of ids and check the stop rule itself on every completion. The CPU path runs the same pipelined logic as CUDA
(``slot_tokens`` / ``from_device`` in the eager decode), so these tests exercise it.

Logprobs are compared exactly when both engines run the same batches. A stop (EOS, stop id, stop string)
is found one step late in async mode, so the next step carries that sequence's discarded row: a batch one
row larger, and CPU GEMMs round rows differently at different batch sizes (~1e-6). There logprobs are
compared to 1e-5, and tokens, text and reasons still exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from flexrollout import LLM, SamplingParams
from flexrollout.bench import random_model

from conftest import random_prompts, tiny_llm

LOGPROB_TOL = 1e-5


# --------------------------------------------------------------------------------------------- helpers


def _pair(model, tok, **overrides) -> tuple[LLM, LLM]:
    """(async, sync) engines with the same settings."""
    return (tiny_llm(model, tok, async_decode=True, **overrides),
            tiny_llm(model, tok, async_decode=False, **overrides))


def _stats(llm) -> dict:
    s = llm.llm_engine.stats
    return {k: getattr(s, k) for k in ("decode_steps", "overlapped_decode_steps", "discarded_tokens",
                                       "preemptions", "generated_tokens")}


def _generate_both(pair, prompts, params):
    """Outputs of both engines, and each engine's counter increments for this call."""
    results = []
    for llm in pair:
        before = _stats(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = _stats(llm)
        results.append((outs, {k: after[k] - before[k] for k in after}))
    (a, da), (b, db) = results
    assert db["overlapped_decode_steps"] == 0 and db["discarded_tokens"] == 0, "sync engine overlapped"
    assert da["overlapped_decode_steps"] > 0, "the async path was not taken"
    assert da["generated_tokens"] == db["generated_tokens"]
    return a, b, da, db


def _assert_logprobs_same(x, y, exact: bool) -> None:
    assert (x is None) == (y is None)
    if x is None:
        return
    assert len(x) == len(y)
    for dx, dy in zip(x, y):
        assert list(dx) == list(dy)                     # the same ids in the same order
        for token in dx:
            lx, ly = dx[token], dy[token]
            assert lx.decoded_token == ly.decoded_token
            if exact:
                assert (lx.rank, lx.logprob) == (ly.rank, ly.logprob)
            else:
                assert lx.logprob == pytest.approx(ly.logprob, abs=LOGPROB_TOL)
                # Batches of other sizes round differently: a neighbour within that tolerance
                # may swap places with the token, moving its rank by one, no more.
                assert abs(lx.rank - ly.rank) <= 1


def _assert_same(a, b, exact_logprobs: bool = True) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.prompt_token_ids == rb.prompt_token_ids
        assert ra.num_cached_tokens == rb.num_cached_tokens
        assert len(ra.outputs) == len(rb.outputs)
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert list(ca.token_ids) == list(cb.token_ids)
            assert (ca.text, ca.finish_reason, ca.stop_reason) == (cb.text, cb.finish_reason, cb.stop_reason)
            _assert_logprobs_same(ca.logprobs, cb.logprobs, exact_logprobs)
            if ca.cumulative_logprob is None or exact_logprobs:
                assert ca.cumulative_logprob == cb.cumulative_logprob
            else:
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=LOGPROB_TOL * 64)


def _engine_is_clean(llm) -> None:
    engine = llm.llm_engine
    assert engine._pending is None
    assert not engine.scheduler.has_work()
    assert engine.pages.num_free_pages == engine.pages.num_pages - 1
    assert engine.pages.num_free_slots == engine.config.max_num_seqs


def _cut_at_stop(path: list[int], stop: int) -> list[int]:
    """What a greedy request with `stop_token_ids=[stop]` returns when HF's greedy path is `path`."""
    return path[:path.index(stop) + 1] if stop in path else path


def _check_stop_rule(outs, stop_ids: set[int], max_tokens) -> None:
    """Each completion ends at its first token in `stop_ids` (finish "stop", that token as the
    reason) or, holding none, runs to max_tokens (finish "length")."""
    for i, out in enumerate(outs):
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        for c in out.outputs:
            tokens = list(c.token_ids)
            first = next((k for k, t in enumerate(tokens) if t in stop_ids), None)
            if first is None:
                assert (len(tokens), c.finish_reason) == (limit, "length")
            else:
                assert len(tokens) == first + 1 and (c.finish_reason, c.stop_reason) == ("stop", tokens[-1])


# Sampled requests stop on every 9th id: on the tiny model's near-flat distribution a sequence
# holds one after ~9 tokens on average, so stops and length endings mix.
SAMPLED_STOPS = list(range(4, 500, 9))


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama(seed=5)


# --------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
def test_length_endings_match_sync_exactly(tiny, sampling):
    """max_tokens differing per prompt: the async engine runs the very same batches (it never schedules a
    sequence past max_tokens, and drains before an admission that a length ending allows), so even the
    logprobs are bit-identical, and no token is computed for nothing."""
    model, tok = tiny
    prompts = random_prompts([5, 12, 20, 33, 7, 9], seed=1)
    params = [SamplingParams(max_tokens=6 + 4 * i, logprobs=2, ignore_eos=True, **sampling)
              for i in range(len(prompts))]
    a, b, da, db = _generate_both(_pair(model, tok), prompts, params)
    _assert_same(a, b, exact_logprobs=True)
    assert [len(o.outputs[0].token_ids) for o in a] == [6 + 4 * i for i in range(len(prompts))]
    assert da["decode_steps"] == db["decode_steps"] and da["discarded_tokens"] == 0


@pytest.mark.parametrize("max_num_seqs", [8, 3], ids=["all-running", "queued"])
def test_stop_ids_found_one_step_late(tiny, hf_greedy, max_num_seqs):
    """EOS-like stop ids end the sequences at different steps, each while the next step is already in
    flight: that step's row is discarded (not appended, not counted), and the outputs stay the same."""
    model, tok = tiny
    prompts = random_prompts([5, 12, 20, 33, 7, 9], seed=2)
    paths = [hf_greedy(model, p, 20).tokens for p in prompts]
    stops = [path[k] for path, k in zip(paths, [2, 4, 6, 8, 10, 12])]
    params = [SamplingParams(temperature=0, max_tokens=20, logprobs=2, stop_token_ids=[s]) for s in stops]
    a, b, da, _ = _generate_both(_pair(model, tok, max_num_seqs=max_num_seqs), prompts, params)
    _assert_same(a, b, exact_logprobs=False)
    for out, path, stop in zip(a, paths, stops):
        assert list(out.outputs[0].token_ids) == _cut_at_stop(path, stop)
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert len({len(o.outputs[0].token_ids) for o in a}) > 1
    assert da["discarded_tokens"] > 0


def test_stop_strings_and_eos_mixed(tiny, hf_greedy):
    """Stop strings (detokenized, found one step late), a stop id, the tokenizer's EOS and a length
    ending in one batch; include_stop_str_in_output both ways."""
    model, tok = tiny
    prompts = random_prompts([6, 11, 17, 25, 8], seed=3)
    ids = [hf_greedy(model, p, 16).tokens for p in prompts]
    words = lambda toks: " ".join(tok.convert_ids_to_tokens(toks))  # noqa: E731
    stop0, stop1 = words(ids[0][2:4]), words(ids[1][5:7])
    params = [
        SamplingParams(temperature=0, max_tokens=16, stop=[stop0], logprobs=1),
        SamplingParams(temperature=0, max_tokens=16, stop=[stop1], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[2][7]], logprobs=0),
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=16, stop=["never appears"], logprobs=2),
    ]
    a, b, da, _ = _generate_both(_pair(model, tok), prompts, params)
    _assert_same(a, b, exact_logprobs=False)
    assert [o.outputs[0].finish_reason for o in a] == ["stop", "stop", "stop", "length", "length"]
    expected = [ids[0][:4], ids[1][:7], _cut_at_stop(ids[2], ids[2][7]), ids[3][:9], ids[4]]
    assert [list(o.outputs[0].token_ids) for o in a] == expected
    # The tokenizer's text of the output, continuing the prompt's (so with its leading space).
    continuation = lambda prompt, out: tok.decode(prompt + out)[len(tok.decode(prompt)):]  # noqa: E731
    full0, full1 = continuation(prompts[0], ids[0][:4]), continuation(prompts[1], ids[1][:7])
    assert a[0].outputs[0].text == full0[:full0.index(stop0)]
    assert a[1].outputs[0].text == full1[:full1.index(stop1) + len(stop1)]
    assert da["discarded_tokens"] > 0


def test_n_samples_per_prompt(tiny):
    """Groups (n > 1, shared prompt pages, forks) with seeded and LLM-seeded sampling, stop ids and logprobs."""
    model, tok = tiny
    prompts = random_prompts([9, 21, 14], seed=4)
    pair = _pair(model, tok, max_num_seqs=8)
    params = [
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=14, logprobs=1, stop_token_ids=SAMPLED_STOPS,
                       ignore_eos=True),
        SamplingParams(n=2, temperature=0.7, top_k=20, max_tokens=10, logprobs=2),   # seeds from LLM(seed)
        SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True),
    ]
    a, b, _, _ = _generate_both(pair, prompts, params)
    _assert_same(a, b, exact_logprobs=False)
    _check_stop_rule(a[:1], set(SAMPLED_STOPS), 14)
    assert "stop" in {c.finish_reason for c in a[0].outputs}
    assert a[1].num_cached_tokens > 0 and len({tuple(c.token_ids) for c in a[2].outputs}) > 1


def test_preemption_drains_first(tiny):
    """8 pages of 16 tokens hold ~1.5 of these sequences: decode must preempt (by recompute), which
    needs the exact host state; the outputs match the sync engine's bit for bit."""
    model, tok = tiny
    prompt_len, max_tokens, block, pages = 20, 60, 16, 8
    assert math.ceil((prompt_len + max_tokens) / block) < pages - 1
    prompts = random_prompts([prompt_len] * 4, seed=31)
    pair = _pair(model, tok, max_num_seqs=4, block_size=block, num_gpu_blocks_override=pages)
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    a, b, da, db = _generate_both(pair, prompts, params)
    _assert_same(a, b, exact_logprobs=True)
    assert da["preemptions"] > 0 and da["preemptions"] == db["preemptions"]
    assert pair[0].llm_engine.stats.preemptions > 0


SPECIAL_TOKENS = 7    # max_tokens of the requests with logits processors


@pytest.mark.parametrize("history_params", [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=0.8, presence_penalty=0.4),
    dict(min_tokens=5, stop_token_ids=SAMPLED_STOPS),
    dict(logit_bias={7: 5.0}, allowed_token_ids=list(range(2, 300))),
    dict(bad_words=["t300"]),
    dict(bad_words=["t300 t301", "t7 t8 t9"]),
], ids=["repetition", "frequency-presence", "min-tokens", "logit-bias-allowed", "one-token-bad-word",
        "multi-token-bad-words"])
def test_processor_rows_pipeline(tiny, history_params):
    """Penalties, biases, min_tokens and bad words (with each slot's recent tokens) keep their state on
    the device, per slot: their rows pipeline like plain ones (every decode step after the first overlaps),
    and the outputs equal the synchronous engine's."""
    model, tok = tiny
    prompts = random_prompts([8, 13, 19, 6], seed=5)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=SPECIAL_TOKENS if i < 2 else 18, logprobs=1,
                             ignore_eos=True, **(history_params if i < 2 else {}))
              for i in range(len(prompts))]
    a, b, da, _ = _generate_both(_pair(model, tok), prompts, params)
    _assert_same(a, b, exact_logprobs=True)
    assert da["overlapped_decode_steps"] == da["decode_steps"] - 1


def test_more_prompts_than_slots(tiny):
    """12 prompts through 4 slots: admissions between decode steps, stops and lengths mixed."""
    model, tok = tiny
    prompts = random_prompts([4 + 3 * i for i in range(12)], seed=6)
    pair = _pair(model, tok, max_num_seqs=4)
    params = [SamplingParams(temperature=0.9, seed=4, max_tokens=5 + i, logprobs=2,
                             stop_token_ids=SAMPLED_STOPS if i % 2 else None, ignore_eos=True)
              for i in range(12)]
    a, b, _, _ = _generate_both(pair, prompts, params)
    _assert_same(a, b, exact_logprobs=False)
    _check_stop_rule(a[1::2], set(SAMPLED_STOPS), [5 + i for i in range(1, 12, 2)])
    assert {o.outputs[0].finish_reason for o in a} == {"stop", "length"}


# --------------------------------------------------------------------------------------------- failures


def _fail_on_call(monkeypatch, obj, name: str, call: int, seen: dict) -> None:
    """Make obj.name raise on its `call`-th call; record whether a step was pending then."""
    original = getattr(obj, name)
    count = {"n": 0}

    def wrapper(*args, **kwargs):
        count["n"] += 1
        if count["n"] == call:
            seen["pending"] = seen["engine"]._pending is not None
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["runner.decode", "engine._check_stop"])
def test_failure_mid_run_leaves_engine_clean(tiny, monkeypatch, where):
    """A failure while a step is in flight (at a launch, or while processing the previous result) leaves
    no pending step, no running sequence and no held page; the next call matches the sync engine."""
    model, tok = tiny
    llm, sync = _pair(model, tok)
    engine = llm.llm_engine
    owner, name = (engine.runner, "decode") if where == "runner.decode" else (engine, "_check_stop")
    seen = {"engine": engine}
    _fail_on_call(monkeypatch, owner, name, call=12, seen=seen)
    prompts = random_prompts([7, 15, 9], seed=7)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True, logprobs=1)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert seen["pending"], "the failure should hit while a decode step was pending"
    _engine_is_clean(llm)
    a, b, _, _ = _generate_both((llm, sync), prompts, params)
    _assert_same(a, b)
    _engine_is_clean(llm)


# --------------------------------------------------------------------------------------------- HF parity


def test_greedy_matches_hf_with_async(tiny, hf_greedy):
    model, tok = tiny
    prompts = random_prompts([5, 14, 27, 9], seed=8)
    llm = tiny_llm(model, tok, async_decode=True)
    before = _stats(llm)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True)
                                  for i in range(4)], use_tqdm=False)
    assert _stats(llm)["overlapped_decode_steps"] > before["overlapped_decode_steps"]
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 8 + 3 * i).tokens


def test_smollm2_eos_and_hf_parity_with_async(smollm2, hf_greedy, stop_ids):
    """Real weights: chat prompts ending with EOS at different steps (and one by length) match HF greedy
    generate, and the sync engine's outputs, with async decode on."""
    model, tok = smollm2
    chats = ["What is the capital of France?", "Say hi.", "Name a color.", "Count from one to ten."]
    ids = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"] for c in chats]
    eos = stop_ids(model, tok)
    max_tokens = 24
    kwargs = dict(max_model_len=256, max_num_seqs=4, block_size=16, num_gpu_blocks_override=64)
    pair = tuple(LLM(model, tokenizer=tok, dtype="float32", async_decode=flag, **kwargs) for flag in (True, False))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    a, b, da, _ = _generate_both(pair, [{"prompt_token_ids": p} for p in ids], params)
    _assert_same(a, b, exact_logprobs=False)
    reasons = []
    for out, prompt in zip(a, ids):
        ref = hf_greedy(model, prompt, max_tokens, eos)
        assert list(out.outputs[0].token_ids) == ref.tokens
        reasons.append(out.outputs[0].finish_reason)
    assert "stop" in reasons and da["discarded_tokens"] > 0
    assert len({len(o.outputs[0].token_ids) for o in a}) > 1


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_async_matches_sync():
    """Random Qwen3-0.6B in fp32 with CUDA graphs: seeded sampling with logprobs and EOS-like stop ids,
    more prompts than slots, async vs sync. Exercises the captured where/gather of slot_tokens, the pinned
    copy-out behind the replay, and the events."""
    model = random_model("qwen3-0.6b", torch.float32, "cuda", 2048)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist()
               for n in (3, 17, 64, 100, 129, 200, 5, 40, 77, 9)]
    kwargs = dict(max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    engines = [LLM(model, async_decode=flag, **kwargs) for flag in (True, False)]
    assert all(e.llm_engine.runner.graphs is not None for e in engines)
    base = dict(temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    stops = list(range(2, vocab, 16))     # ~1 in 16 draws of a near-flat distribution stops
    params = [SamplingParams(max_tokens=20 + 2 * i, logprobs=2, stop_token_ids=stops if i % 3 else None,
                             **base) for i in range(len(prompts))]
    before = [_stats(e) for e in engines]
    a = engines[0].generate(prompts, params, use_tqdm=False)
    b = engines[1].generate(prompts, params, use_tqdm=False)
    delta = {k: _stats(engines[0])[k] - before[0][k] for k in before[0]}
    assert delta["overlapped_decode_steps"] > 0 and delta["discarded_tokens"] > 0
    assert engines[0].llm_engine.runner.graphs.graphs, "decode should have replayed captured graphs"
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert list(cx.token_ids) == list(cy.token_ids)
        assert (cx.finish_reason, cx.stop_reason) == (cy.finish_reason, cy.stop_reason)
        for dx, dy in zip(cx.logprobs, cy.logprobs):
            assert list(dx) == list(dy)
            for t in dx:
                assert dx[t].logprob == pytest.approx(dy[t].logprob, abs=1e-4)
    _check_stop_rule([o for i, o in enumerate(a) if i % 3], set(stops),
                     [20 + 2 * i for i in range(len(prompts)) if i % 3])
    assert {o.outputs[0].finish_reason for o in a} == {"stop", "length"}
    _engine_is_clean(engines[0])
