"""Logits processing, sampling and logprobs, vectorised over the batch on the device.

Order (per row): allowed_token_ids / bad words / logit_bias / min_tokens masks, then
repetition, frequency and presence penalties, then temperature. The *processed* logprobs
reported to the user are log_softmax of those logits (vLLM's `processed_logprobs`): they include
temperature and penalties, and they do NOT include top-k / top-p / min-p truncation, which
matches what TRL recomputes for its importance-sampling correction. Truncation then masks the
logits, and a token is drawn by the Gumbel-max trick (exact sampling from the truncated softmax).

The Gumbel noise is a counter-based hash of (row seed, position, token id): a seeded request
draws the same tokens whatever else shares its batch and whatever slot it sits in, and nothing
in here needs a host sync or a data-dependent shape, so it can live inside a CUDA graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _int32(value: int) -> int:
    """A 32-bit pattern as the int32 value that holds it (two's complement)."""
    return value - (1 << 32) if value >= 1 << 31 else value


_MUL1, _MUL2, _MUL_TOKEN = _int32(0x7FEB352D), _int32(0x846CA68B), _int32(0x2545F491)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int32 tensors. Products wrap modulo 2^32 as the hash
    wants; `>>` is arithmetic on int32, so each shift is masked to a logical one. (int32, not
    int64: half the bytes, and no masking after each product.)"""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """(B,) int32 keys: one per (int64 seed, position of the token being drawn)."""
    low = (seeds & _MASK32).sub(1 << 31).to(torch.int32)           # exact: in int32 range
    high = ((seeds >> 32) & _MASK32).sub(1 << 31).to(torch.int32)
    counter = (counters & _MASK32).sub(1 << 31).to(torch.int32)
    row = _mix32(low ^ _mix32(high ^ _int32(0x9E3779B9)))
    return _mix32(row + counter * _int32(0x632BE5AB))


def token_bits(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int32 hash values of (row key, token id) pairs, broadcast against each other."""
    return _mix32(keys ^ (token_ids.to(torch.int32) * _MUL_TOKEN))


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from hash values, finite for every possible value.

    The top 23 of the 32 bits give v = (k + 1/2) / 2^23, strictly inside (0, 1) and exact in float32 (24
    bits would reach 1 - 2^-25, which rounds to 1.0). The exponential -log(1 - v) is taken with
    log1p, exact near v = 0 and positive everywhere, so -log of it lies in [-2.9, 16.7]. A plain
    log of u near 1 could return 0 on the GPU's approximate log, and -log(0) is +inf.
    """
    v = (((bits >> 9) & 0x7FFFFF).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log1p(-v))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) standard Gumbel noise, a pure function of (seed, counter, token id)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return gumbel_from_bits(token_bits(row_keys(seeds, counters)[:, None], ids[None, :]))


@dataclass
class SamplingTensors:
    """Per-row sampling settings for one step, built on the host by `build_sampling_tensors`."""

    temperature: torch.Tensor        # (B,) float; rows with 0 are greedy
    top_k: torch.Tensor              # (B,) int64; vocab size when off
    top_p: torch.Tensor              # (B,) float
    min_p: torch.Tensor              # (B,) float
    seeds: torch.Tensor              # (B,) int64
    counters: torch.Tensor           # (B,) int64: position of the token being drawn
    bias: torch.Tensor | None        # (B, V) additive (logit_bias, bans) or None
    penalties: tuple | None          # (rep, freq, pres, counts, prompt_mask) or None
    need_truncation: bool            # any row uses top-k / top-p / min-p
    all_greedy: bool
    max_logprobs: int                # largest `logprobs` k in the batch; -1 when none asked


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor          # (B,)
    logprobs: torch.Tensor | None    # (B,) processed logprob of the sampled token
    ranks: torch.Tensor | None       # (B,) its rank (1 = most likely)
    top_ids: torch.Tensor | None     # (B, k)
    top_logprobs: torch.Tensor | None


def apply_penalties(logits: torch.Tensor, penalties: tuple) -> torch.Tensor:
    """HF's repetition penalty over prompt + output tokens; vLLM's frequency/presence over output."""
    rep, freq, pres, counts, prompt_mask = penalties
    seen = (counts > 0) | prompt_mask
    scaled = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
    logits = torch.where(seen, scaled, logits)
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k, the top-p nucleus and the min-p floor with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    probs = sorted_logits.softmax(dim=-1)
    # A token stays in the nucleus while the mass strictly before it is below top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
    drop = drop | (probs < min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# Rows of an eager (CPU) draw hashed at once: bounds its (rows, V) temporaries (a 152k vocabulary
# makes each 0.6 MB per row) so they are reused instead of mapped fresh for every operation.
_EAGER_ROWS = 16


def draw(logits: torch.Tensor, sample_logits: torch.Tensor, greedy: torch.Tensor,
         seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Greedy rows: argmax of `logits`; the others: Gumbel-max over `sample_logits`.

    Noise is added only where a token may be drawn: a masked token (-inf) stays -inf whatever the
    noise, so it can never be drawn, and no NaN (-inf + inf, or a NaN logit) reaches the argmax,
    which would take it as the maximum. On CUDA this is compiled into the argmax.
    """
    rows = logits.shape[0]
    if not logits.is_cuda and rows > _EAGER_ROWS:
        return torch.cat([draw(*(t[i:i + _EAGER_ROWS] for t in (logits, sample_logits, greedy, seeds, counters)))
                          for i in range(0, rows, _EAGER_ROWS)])
    noise = gumbel_noise(seeds, counters, logits.shape[-1])
    drawable = sample_logits > float("-inf")          # False for -inf and for NaN
    noisy = torch.where(drawable, sample_logits + noise, float("-inf"))
    return torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))


def token_logprob_rank(logits: torch.Tensor, token_ids: torch.Tensor):
    """log_softmax(logits) at `token_ids`, and the token's rank (1 = most likely), from one
    logsumexp: the full (B, V) log-softmax is never materialised."""
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logits > chosen[:, None]).sum(dim=-1) + 1
    return chosen - lse, ranks, lse


@functools.cache
def _fused(fn):
    """`fn` compiled for CUDA tensors. Inductor folds the hash noise and the comparisons into the
    reductions, so no (B, V) int64 or bool temporaries exist (eagerly they are several hundred MB
    at batch 64 with a 152k vocabulary). CPU runs `fn` as is."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: (B, V) fp32 -> sampled ids (and logprobs when asked)."""
    if st.bias is not None:
        logits = logits + st.bias
    if st.penalties is not None:
        logits = apply_penalties(logits, st.penalties)
    greedy = st.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits / temperature[:, None]
    fused = _fused if logits.is_cuda else (lambda fn: fn)

    lp = top_ids = top_lp = ranks = None
    if st.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        sample_logits = truncate(logits, st.top_k, st.top_p, st.min_p) if st.need_truncation else logits
        token_ids = fused(draw)(logits, sample_logits, greedy, st.seeds, st.counters)
    if st.max_logprobs >= 0:
        lp, ranks, lse = fused(token_logprob_rank)(logits, token_ids)
        if st.max_logprobs > 0:
            top_logits, top_ids = logits.topk(st.max_logprobs, dim=-1)
            top_lp = top_logits - lse[:, None]
    return SamplerOutput(token_ids, lp, ranks, top_ids, top_lp)


def _bias_rows(seqs, vocab: int) -> torch.Tensor | None:
    """Additive (B, V) row biases: allowed_token_ids, bad words, logit_bias, min_tokens bans."""
    rows = []
    for seq in seqs:
        p = seq.params
        bans = seq.banned_next_tokens()
        holding_stop = seq.num_generated + seq.num_pending < p.min_tokens
        if not (p.allowed_token_ids or p.logit_bias or bans or holding_stop):
            rows.append(None)
            continue
        row = torch.zeros(vocab)
        if p.allowed_token_ids:
            row.fill_(float("-inf"))
            row[list(p.allowed_token_ids)] = 0.0
        for token, value in (p.logit_bias or {}).items():
            row[int(token)] += float(value)
        banned = list(bans) + (list(seq.stop_ids) if holding_stop else [])
        if banned:
            row[banned] = float("-inf")
        rows.append(row)
    if all(r is None for r in rows):
        return None
    zero = torch.zeros(vocab)
    return torch.stack([zero if r is None else r for r in rows])


def has_static_sampling(seq) -> bool:
    """This row needs no bias row and no penalty counts: its settings do not depend on the
    tokens generated so far, so its step can be built before the previous token is read back
    (and replayed from a CUDA graph). Mirrors `_bias_rows` and `_penalty_state`."""
    p = seq.params
    return not (p.allowed_token_ids or p.logit_bias or seq.bad_words_ids
                or seq.num_generated + seq.num_pending < p.min_tokens
                or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)


def _penalty_state(seqs, vocab: int) -> tuple | None:
    params = [s.params for s in seqs]
    if all(p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
           for p in params):
        return None
    counts = torch.zeros(len(seqs), vocab)
    prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        generated = torch.tensor(seq.generated_ids, dtype=torch.long)
        counts[row].index_add_(0, generated, torch.ones(len(generated)))
        prompt_mask[row, torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long)] = True
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    return rep, freq, pres, counts, prompt_mask


def build_sampling_tensors(seqs, vocab: int) -> SamplingTensors:
    """Per-row settings of the sequences about to draw their next token, as host tensors."""
    params = [s.params for s in seqs]
    top_k = [p.top_k if p.top_k and p.top_k > 0 else vocab for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    temperature = [float(p.temperature) for p in params]
    need_truncation = any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(min_p)
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32),
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64),
        counters=torch.tensor([s.num_tokens_with_pending for s in seqs], dtype=torch.int64),
        bias=_bias_rows(seqs, vocab),
        penalties=_penalty_state(seqs, vocab),
        need_truncation=need_truncation,
        all_greedy=all(t == 0 for t in temperature),
        max_logprobs=max((vocab if k == -1 else k for k in logprob_ks), default=-1),
    )


_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "counters")


def sampling_to_device(st: SamplingTensors, device: torch.device) -> SamplingTensors:
    """Move host sampling tensors to the device: per-row vectors in one packed transfer."""
    if device.type == "cpu":
        return st
    packed = pack_rows([getattr(st, f) for f in _ROW_FIELDS]).to(device, non_blocking=True)
    moved = {f: unpack_row(packed[i], getattr(st, f).dtype) for i, f in enumerate(_ROW_FIELDS)}
    bias = None if st.bias is None else st.bias.to(device, non_blocking=True)
    penalties = None if st.penalties is None else tuple(t.to(device) for t in st.penalties)
    return SamplingTensors(**moved, bias=bias, penalties=penalties, need_truncation=st.need_truncation,
                           all_greedy=st.all_greedy, max_logprobs=st.max_logprobs)


def pack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack int64 and float32 vectors into one pinned int64 tensor (floats bit-cast), so a
    step's per-row settings cross to the device in one copy."""
    packed = torch.stack([float_bits(r) if r.dtype == torch.float32 else r for r in rows])
    return packed.pin_memory() if torch.cuda.is_available() else packed


def float_bits(row: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 holding its bit pattern in the low 32 bits (sign-extended, so the value
    stays in int32 range and `unpack_row` or a low-half float32 view gets the float back)."""
    return row.view(torch.int32).to(torch.int64)


def unpack_row(row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return row.to(torch.int32).view(torch.float32) if dtype == torch.float32 else row
