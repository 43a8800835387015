"""Sampling at a real vocabulary size (Qwen3's 151,936 tokens).

A flaw that hits one (row, token) pair in 2^24 is rare at a 512-token vocabulary and common at
152k: the Gumbel draw once reached +inf there (a uniformly random token, or a banned one through
-inf + inf = NaN) in ~0.9% of rows. These tests run a tiny Llama with that vocabulary, its lm_head
scaled so the next-token distribution is concentrated (99.9% of the mass in ~100 tokens):

* every truncation and ban (allowed_token_ids, bad_words, top_k, top_p, min_p) draws thousands of
  tokens, and **none** may fall outside what the option allows, judged on HF's own logits (and
  the engine's reported rank for top-k);
* a chi-square test of the untruncated distribution against HF's softmax, whose power is shown by
  running the same statistic on draws made with the old noise formula, which it must reject;
* the Gumbel noise is finite for every possible hash value (all 2^23 values it reads).

The same tests run on the GPU (marked), where the sampler is compiled.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny_model
from flexrollout import LLM, SamplingParams
from flexrollout.engine import sampler

VOCAB = 151_936
PEAKY_SCALE = 60.0      # lm_head multiplier: logit std ~9.5, 99.9% of the mass in ~20-100 tokens
PROMPTS = [[17, 250, 33, 401, 8], [5000, 60000, 150000, 7], [99, 98, 97], [123456, 42, 4242, 31337, 9]]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def model_and_tok():
    model, tok = make_tiny_model("llama", vocab_size=VOCAB, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAKY_SCALE)
    return model, tok


def _llm(model, tok, device: str) -> LLM:
    # flex_attention's CUDA kernels need pages of at least 128 tokens (one page per sequence here)
    pages = dict(block_size=16, num_gpu_blocks_override=600) if device == "cpu" else \
        dict(block_size=128, num_gpu_blocks_override=300)
    return LLM(model.to(device), tokenizer=tok, dtype="float32", max_model_len=64, max_num_seqs=256,
               max_num_batched_tokens=256, seed=0, **pages)


class _Reference:
    """HF's fp64 next-token probabilities after a prefix, computed once per distinct prefix."""

    def __init__(self, model) -> None:
        self.model, self.cache = model, {}

    @torch.no_grad()
    def probs(self, prefix: list[int]) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self.cache:
            ids = torch.tensor([prefix], device=self.model.device)
            self.cache[key] = self.model(ids).logits[0, -1].double().cpu().softmax(-1)
        return self.cache[key]


# Each option, for one prompt: bans are built from the prompt's own distribution so that they
# remove most of its mass (bad words: the 16 likeliest tokens; the allowed set leaves out the 8
# likeliest), and a broken ban could not pass unseen.
def _bans(probs: torch.Tensor) -> dict[str, dict]:
    order = probs.argsort(descending=True).tolist()
    return {"allowed_token_ids": dict(allowed_token_ids=order[8:40] + [3, 70000, 151000]),
            "bad_words": dict(bad_words=[f"t{t}" for t in order[:16]])}


TRUNCATIONS = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.5), "min_p": dict(min_p=0.05)}


def _allowed(option: str, kwargs: dict, probs: torch.Tensor, token: int, rank: int) -> bool:
    """Whether `token` (reported rank `rank`) may be drawn under `option`, by HF's probabilities
    at T = 1."""
    if option == "allowed_token_ids":
        return token in kwargs["allowed_token_ids"]
    if option == "bad_words":
        return f"t{token}" not in kwargs["bad_words"]
    above = probs[probs > probs[token]]
    if option == "top_k":
        return rank <= kwargs["top_k"] and above.numel() < kwargs["top_k"]
    if option == "top_p":
        # In the nucleus while the mass strictly before it is below top_p (1e-6: fp32 vs fp64).
        return float(above.sum()) < kwargs["top_p"] + 1e-6
    if option == "min_p":
        return float(probs[token]) >= kwargs["min_p"] * float(probs.max()) * (1 - 1e-6)
    raise AssertionError(option)


def _banned_mass(option: str, kwargs: dict, probs: torch.Tensor) -> float:
    """HF's probability of the tokens a ban removes."""
    banned = torch.zeros(VOCAB, dtype=torch.bool)
    if option == "allowed_token_ids":
        banned[:] = True
        banned[kwargs["allowed_token_ids"]] = False
    else:
        banned[[int(word[1:]) for word in kwargs["bad_words"]]] = True
    return float(probs[banned].sum())


# CPU: 512 samples x 4 prompts x 1 token = 2,048 draws per option, 10,240 in all. The old noise
# drew a random token in ~0.9% of rows, so each option would have seen ~19 bad draws (missing all
# of them: p ~ 1e-8). GPU: 4 x 1,024 x 2 tokens = 8,192 per option, the second token from the
# decode graph (the truncation rows) or eagerly (the bans, whose bias rows run outside graphs).
DRAWS = {"cpu": (512, 1), "cuda": (1024, 2)}


@pytest.mark.parametrize("device", DEVICES)
def test_no_draw_outside_what_the_options_allow(model_and_tok, device):
    model, tok = model_and_tok
    llm = _llm(model, tok, device)
    ref = _Reference(model)
    samples, max_tokens = DRAWS[device]
    draws = {}
    # Truncations and bans in separate calls: a batch with a bias row runs eagerly.
    for kind in ("truncations", "bans"):
        prompts, params, cases = [], [], []
        for prompt in PROMPTS:
            options = TRUNCATIONS if kind == "truncations" else _bans(ref.probs(prompt))
            for option, kwargs in options.items():
                prompts.append({"prompt_token_ids": prompt})
                params.append(SamplingParams(n=samples, max_tokens=max_tokens, temperature=1.0,
                                             logprobs=0, ignore_eos=True, seed=len(cases), **kwargs))
                cases.append((option, kwargs, prompt))
        for out, (option, kwargs, prompt) in zip(llm.generate(prompts, params, use_tqdm=False), cases):
            bad = []
            for completion in out.outputs:
                for step, token in enumerate(completion.token_ids):
                    probs = ref.probs(prompt + completion.token_ids[:step])
                    draws[option] = draws.get(option, 0) + 1
                    if not _allowed(option, kwargs, probs, token, completion.logprobs[step][token].rank):
                        bad.append(token)
            assert not bad, f"{option}: {len(bad)} draws not allowed, e.g. {bad[:5]}"
            if kind == "bans":
                assert _banned_mass(option, kwargs, ref.probs(prompt)) > 0.5
    expected = samples * max_tokens * len(PROMPTS)
    assert draws == dict.fromkeys([*TRUNCATIONS, "allowed_token_ids", "bad_words"], expected), draws


# --------------------------------------------------------------------------------------------- distribution

DIST_PROMPT = PROMPTS[0]
DIST_SAMPLES = 2048
NEGLIGIBLE = 1e-6       # tokens this unlikely under HF: the old sampler drew them ~0.9% of the time


def _old_gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The noise of the sampler before the fix: 24 bits, u = (k + 1/2) / 2^24, -log(-log(u)). The
    top value rounds u to 1.0 in float32, giving +inf. Kept here only to show the tests' power."""
    uniform = (((bits >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square; tokens expecting fewer than 5 draws share one pooled bin."""
    expected = float(counts.sum()) * probs
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


def _chi2_critical(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a standard-normal z (z = 5: p ~ 3e-7)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _poisson_tail(k: int, lam: float) -> float:
    """P(X >= k) for X ~ Poisson(lam)."""
    return max(0.0, 1.0 - sum(math.exp(-lam) * lam ** i / math.factorial(i) for i in range(k)))


def _rejections(counts: torch.Tensor, probs: torch.Tensor) -> list[str]:
    """Why the draws do not follow `probs` (empty: they pass), each test at p < ~3e-7: a chi-square
    of the shape, and an exact Poisson test of the draws of negligible tokens."""
    why = []
    stat, df = _chi2(counts, probs)
    assert df >= 5, "too few bins: the test would have no power"
    if stat > _chi2_critical(df):
        why.append(f"chi2={stat:.1f} df={df} > {_chi2_critical(df):.1f}")
    negligible = probs < NEGLIGIBLE
    hits, lam = int(counts[negligible].sum()), float(counts.sum()) * float(probs[negligible].sum())
    if _poisson_tail(hits, lam) < 3e-7:
        why.append(f"{hits} draws of tokens below p={NEGLIGIBLE} (expected {lam:.2g})")
    return why


def _draw_counts(model, tok, device: str) -> torch.Tensor:
    llm = _llm(model, tok, device)
    sp = SamplingParams(n=DIST_SAMPLES, max_tokens=1, temperature=1.0, ignore_eos=True, seed=7,
                        detokenize=False)
    out = llm.generate([{"prompt_token_ids": DIST_PROMPT}], sp, use_tqdm=False)[0]
    ids = torch.tensor([c.token_ids[0] for c in out.outputs])
    return torch.bincount(ids, minlength=VOCAB)


@pytest.mark.parametrize("device", DEVICES)
def test_distribution_at_real_vocab_and_power_against_old_noise(model_and_tok, device, monkeypatch):
    model, tok = model_and_tok
    probs = _Reference(model).probs(DIST_PROMPT)
    assert not _rejections(_draw_counts(model, tok, device), probs)

    # Power: the same tests reject the draws of the old noise, with its random +inf tokens.
    monkeypatch.setattr(sampler, "gumbel_from_bits", _old_gumbel_from_bits)
    sampler._fused.cache_clear()        # the compiled draw (CUDA) must see the swapped function
    try:
        old_counts = _draw_counts(model, tok, device)
    finally:
        monkeypatch.undo()
        sampler._fused.cache_clear()
    assert _rejections(old_counts, probs), "no power: the old sampler's draws pass"


# --------------------------------------------------------------------------------------------- the noise


def _as_int32(patterns: torch.Tensor) -> torch.Tensor:
    """32-bit patterns held in int64 -> the int32 values with those bits (the hash's dtype)."""
    return torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_noise_is_finite_for_every_hash_value(device):
    """The noise reads the top 23 bits of a 32-bit hash: every one of their 2^23 values, with the
    low bits all zeros and all ones, gives finite noise (compiled on CUDA, as the engine runs it)."""
    top = torch.arange(1 << 23, dtype=torch.int64) << 9
    noise_fn = torch.compile(sampler.gumbel_from_bits) if device == "cuda" else sampler.gumbel_from_bits
    for low in (0, (1 << 9) - 1):
        noise = noise_fn(_as_int32(top | low).to(device))
        assert bool(torch.isfinite(noise).all())
        # The extremes: -log(-log1p(-v)) at v = 2^-24 is 24 ln 2; at v = 1 - 2^-24, -log(24 ln 2).
        assert abs(float(noise.max()) - 24 * math.log(2)) < 1e-3
        assert abs(float(noise.min()) + math.log(24 * math.log(2))) < 1e-3
    # The old formula fails on the all-ones hash: the check above can fail.
    assert torch.isinf(_old_gumbel_from_bits(_as_int32(torch.tensor([0xFFFFFFFF])))).all()


def test_masked_tokens_never_win_even_against_infinite_noise(monkeypatch):
    """The draw guards itself: with noise forced to +inf on every token, a masked (-inf) token is
    still never drawn, and no NaN decides the argmax."""
    logits = torch.full((3, 10), float("-inf"))
    logits[0, 4] = 0.0
    logits[1, [2, 7]] = torch.tensor([1.0, 5.0])
    logits[2, :] = torch.linspace(0, 1, 10)
    logits[2, 9] = float("-inf")
    monkeypatch.setattr(sampler, "gumbel_from_bits", lambda bits: torch.full(bits.shape, float("inf")))
    token = sampler.draw(logits, logits, torch.zeros(3, dtype=torch.bool), torch.arange(3),
                         torch.zeros(3, dtype=torch.long))
    assert token[0] == 4 and token[1] in (2, 7) and token[2] != 9
