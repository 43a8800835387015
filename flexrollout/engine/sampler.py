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

The logits processors' state lives on the device, one row per batch slot (`SlotSampling`), and
is indexed by each row's slot: static bias rows (allowed_token_ids, logit_bias, one-token bad
words), multi-token bad words with each slot's last generated tokens, the min_tokens stop ban,
and the penalties' counts and prompt mask. The step itself appends the token it draws to its
slot's history and counts. So a step that applies them needs nothing from the host but its
slots, replays from a CUDA graph, and can be queued before the previous token is read back.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

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
    need_truncation: bool            # any row uses top-k / top-p / min-p
    all_greedy: bool
    max_logprobs: int                # largest `logprobs` k in the batch; -1 when none asked
    slots: torch.Tensor | None = None                # (B,) int64 batch slot of each row
    processors: tuple[str, ...] = ()                 # parts of `slot_state` this step applies
    slot_state: SlotSampling | None = field(default=None, repr=False)


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
    """logits: (B, V) fp32 -> sampled ids (and logprobs when asked). A step with processors also
    records its drawn tokens in their slots' state (penalty counts, bad-word histories)."""
    fused = _fused if logits.is_cuda else (lambda fn: fn)
    if st.processors:
        logits = fused(process_logits)(logits, st.counters, *st.slot_state.step_tensors(st.slots, st.processors))
    greedy = st.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits / temperature[:, None]

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
    if st.processors:
        st.slot_state.record(st.slots, token_ids, st.processors)
    return SamplerOutput(token_ids, lp, ranks, top_ids, top_lp)


def process_logits(logits: torch.Tensor, counters: torch.Tensor,
                   slots: torch.Tensor, bias: torch.Tensor | None, bad_words: tuple | None,
                   stop_mask: torch.Tensor | None, min_end: torch.Tensor | None,
                   penalty_params: torch.Tensor | None, counts: torch.Tensor | None,
                   prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """The logits processors in the module's order, over per-slot state gathered by `slots`
    (a part that is None is skipped): the static bias row, multi-token bad words, min_tokens'
    stop ids while fewer than min_tokens are generated, then the penalties. On CUDA this is
    compiled: the gathers fold into one pass instead of a dozen (B, V) temporaries."""
    if bias is not None:
        logits = logits + bias[slots]
    if bad_words is not None:
        logits = ban_bad_words(logits, slots, *bad_words)
    if stop_mask is not None:
        holding = counters < min_end[slots]
        logits = logits.masked_fill(stop_mask[slots] & holding[:, None], float("-inf"))
    if penalty_params is not None:
        rep, freq, pres = penalty_params[:, slots]
        logits = apply_penalties(logits, (rep, freq, pres, counts[slots], prompt_mask[slots]))
    return logits


WILDCARD = -1      # a bad word's prefix padding: matches any history token
HOLE = -2          # a history position before the first generated token: matches no prefix token


def ban_bad_words(logits: torch.Tensor, slots: torch.Tensor, prefixes: torch.Tensor,
                  last_tokens: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """vLLM's rule for multi-token bad words: a word's last token is banned when its other tokens
    end the generated output. `prefixes` (slots, W, L): each word but its last token,
    right-aligned and WILDCARD-padded; `last_tokens` (slots, W), -1 for no word; `history`
    (slots, L): the slot's last L generated tokens, right-aligned, HOLE before the first."""
    prefix, last = prefixes[slots], last_tokens[slots]                      # (B, W, L), (B, W)
    ends_output = ((prefix == history[slots][:, None, :]) | (prefix == WILDCARD)).all(-1)
    ban = torch.where(ends_output & (last >= 0), float("-inf"), 0.0)
    return logits.scatter_add(1, last.clamp(min=0), ban)


# The parts of the per-slot state, each allocated when a request first needs it.
SLOT_PARTS = ("bias", "bad_words", "min_tokens", "penalties")


def slot_parts(seq) -> tuple[str, ...]:
    """The parts of `SlotSampling` this sequence's rows use."""
    p = seq.params
    wanted = {
        "bias": bool(p.allowed_token_ids or p.logit_bias or seq.one_token_bad_words),
        "bad_words": bool(seq.multi_token_bad_words),
        "min_tokens": p.min_tokens > 0 and bool(seq.stop_ids),
        "penalties": (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                      or p.presence_penalty != 0.0),
    }
    return tuple(part for part in SLOT_PARTS if wanted[part])


def step_parts(seqs) -> tuple[str, ...]:
    """The parts a step over `seqs` applies: those any of its rows uses (the others' rows are
    neutral). Static for a sequence's life, so a decode batch keeps one graph mode."""
    used = {part for seq in seqs for part in slot_parts(seq)}
    return tuple(part for part in SLOT_PARTS if part in used)


class SlotSampling:
    """The logits processors' state, one row per batch slot, on the engine's device.

    Rows are written when a sequence gets its slot, at the sampling of its prefill (the host
    state is exact there: counts cover the tokens generated before a preemption); every admitted
    row is written, the neutral values included, so a reused slot inherits nothing. Penalty
    counts then grow on the device with each drawn token (`count`), inside the step. A step
    gathers rows by slot, so it needs no host-built (B, V) tensor and can replay from a graph;
    padding rows read and write slot 0, which no sequence holds.

    Each part is allocated when a request first needs it (10 bytes per slot and vocab entry for
    all of them: 390 MB at 257 slots x 152k; the bad words take a few KB per slot) and dropped
    on sleep with the KV cache. The bad-word tensors grow when a request has more or longer
    words than they hold; `bad_words_version` counts their replacements (graphs read them).
    """

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.num_slots, self.vocab, self.device = num_slots, vocab, device
        self.bad_words_version = 0
        self.release()

    @staticmethod
    def max_bytes(num_slots: int, vocab: int) -> int:
        """Every part allocated: bias and counts fp32, two bool masks, per-slot scalars (the bad
        words' few KB per slot are left out)."""
        return num_slots * (vocab * (4 + 4 + 1 + 1) + 3 * 4 + 8)

    def release(self) -> None:
        self.bias: torch.Tensor | None = None           # (slots, V) additive, -inf bans
        self.bad_prefixes: torch.Tensor | None = None   # (slots, W, L) words but their last token
        self.bad_last: torch.Tensor | None = None       # (slots, W) their last tokens, -1: none
        self.history: torch.Tensor | None = None        # (slots, L) last generated tokens
        self.stop_mask: torch.Tensor | None = None      # (slots, V) stop ids held back by min_tokens
        self.min_end: torch.Tensor | None = None        # (slots,) position before which they are
        self.penalty_params: torch.Tensor | None = None  # (3, slots): repetition, frequency, presence
        self.counts: torch.Tensor | None = None         # (slots, V) generated-token counts
        self.prompt_mask: torch.Tensor | None = None    # (slots, V) prompt tokens

    def allocated(self, part: str) -> bool:
        return {"bias": self.bias, "bad_words": self.bad_last, "min_tokens": self.stop_mask,
                "penalties": self.counts}[part] is not None

    def _allocate(self, part: str) -> None:
        shape, kw = (self.num_slots, self.vocab), {"device": self.device}
        if part == "bias":
            self.bias = torch.zeros(shape, **kw)
            tensors = (self.bias,)
        elif part == "min_tokens":
            self.stop_mask = torch.zeros(shape, dtype=torch.bool, **kw)
            self.min_end = torch.zeros(self.num_slots, dtype=torch.long, **kw)
            tensors = (self.stop_mask, self.min_end)
        else:
            self.counts = torch.zeros(shape, **kw)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, **kw)
            # Neutral for every slot: rows admitted before this part existed apply nothing.
            self.penalty_params = torch.tensor([[1.0], [0.0], [0.0]], **kw).repeat(1, self.num_slots)
            tensors = (self.counts, self.prompt_mask, self.penalty_params)
        size = sum(t.numel() * t.element_size() for t in tensors)
        logger.info("logits-processor state '%s': %.1f MiB (%d slots x %d vocab)",
                    part, size / 2**20, self.num_slots, self.vocab)

    @torch.inference_mode()
    def admit(self, seqs) -> None:
        """Write the rows of sequences about to draw their first token in their slots. (Inference
        mode, like the steps that update them: tensors made under it may only change under it,
        whatever mode the caller of `generate` is in.)"""
        for part in SLOT_PARTS:
            if part == "bad_words":
                self._fit_bad_words(seqs)                   # allocates, or grows to fit
            elif not self.allocated(part) and any(part in slot_parts(seq) for seq in seqs):
                self._allocate(part)
        slots = self._ids([seq.slot for seq in seqs])
        if self.bias is not None:
            self._admit_bias(seqs, slots)
        if self.bad_last is not None:
            self._admit_bad_words(seqs, slots)
        if self.stop_mask is not None:
            self._admit_min_tokens(seqs, slots)
        if self.counts is not None:
            self._admit_penalties(seqs, slots)

    def _ids(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _put(self, target: torch.Tensor, cells: list[tuple[int, int]], value, accumulate=False) -> None:
        """target[slot, token] = value (or += value) at each (slot, token) of `cells`; `value` is
        one for all cells or a list of one per cell."""
        if not cells:
            return
        rows, cols = zip(*cells)
        values = torch.as_tensor(value, dtype=target.dtype).expand(len(cells)).to(self.device)
        target.index_put_((self._ids(rows), self._ids(cols)), values, accumulate=accumulate)

    def _admit_bias(self, seqs, slots: torch.Tensor) -> None:
        """allowed_token_ids (-inf outside the set), plus logit_bias, then one-token bad words
        banned: the order `_bias_rows` used to build these rows in on the host."""
        self.bias.index_fill_(0, slots, 0.0)
        allowed = [seq for seq in seqs if seq.params.allowed_token_ids]
        if allowed:
            self.bias.index_fill_(0, self._ids([seq.slot for seq in allowed]), float("-inf"))
            self._put(self.bias, [(seq.slot, t) for seq in allowed for t in seq.params.allowed_token_ids], 0.0)
        biased = [((seq.slot, int(t)), float(v)) for seq in seqs for t, v in (seq.params.logit_bias or {}).items()]
        if biased:
            cells, values = zip(*biased)
            self._put(self.bias, list(cells), list(values), accumulate=True)
        self._put(self.bias, [(seq.slot, t) for seq in seqs for t in seq.one_token_bad_words], float("-inf"))

    def _fit_bad_words(self, seqs) -> None:
        """Make the bad-word tensors hold `seqs`' words: grown to powers of two, old rows kept
        right-aligned (a grown history's new left columns are HOLE, and the old rows' prefixes
        are WILDCARD there, so their matches do not change)."""
        words = length = 0
        for seq in seqs:
            multi = seq.multi_token_bad_words
            words = max(words, len(multi))
            length = max([length] + [len(w) - 1 for w in multi])
        if words == 0:
            return
        held_words, held_length = (0, 0) if self.bad_last is None else self.bad_prefixes.shape[1:]
        if words <= held_words and length <= held_length:
            return
        words = max(held_words, 1 << (words - 1).bit_length(), 4)
        length = max(held_length, 1 << (length - 1).bit_length(), 4)
        kw = {"dtype": torch.long, "device": self.device}
        prefixes = torch.full((self.num_slots, words, length), WILDCARD, **kw)
        last = torch.full((self.num_slots, words), -1, **kw)
        history = torch.full((self.num_slots, length), HOLE, **kw)
        if self.bad_last is not None:
            prefixes[:, :held_words, length - held_length:] = self.bad_prefixes
            last[:, :held_words] = self.bad_last
            history[:, length - held_length:] = self.history
        self.bad_prefixes, self.bad_last, self.history = prefixes, last, history
        self.bad_words_version += 1
        logger.info("logits-processor state 'bad_words': %d words of up to %d + 1 tokens per slot",
                    words, length)

    def _admit_bad_words(self, seqs, slots: torch.Tensor) -> None:
        """Each row's words right-aligned, and its last generated tokens (exact on the host now,
        after a preemption too): rows without words get none, so a reused slot bans nothing."""
        words, length = self.bad_prefixes.shape[1:]
        prefixes = torch.full((len(seqs), words, length), WILDCARD, dtype=torch.long)
        last = torch.full((len(seqs), words), -1, dtype=torch.long)
        history = torch.full((len(seqs), length), HOLE, dtype=torch.long)
        for row, seq in enumerate(seqs):
            for w, word in enumerate(seq.multi_token_bad_words):
                prefixes[row, w, length - len(word) + 1:] = torch.tensor(word[:-1])
                last[row, w] = word[-1]
            tail = seq.generated_ids[-length:]
            if tail:
                history[row, length - len(tail):] = torch.tensor(tail)
        self.bad_prefixes.index_copy_(0, slots, prefixes.to(self.device))
        self.bad_last.index_copy_(0, slots, last.to(self.device))
        self.history.index_copy_(0, slots, history.to(self.device))

    def _admit_min_tokens(self, seqs, slots: torch.Tensor) -> None:
        self.stop_mask.index_fill_(0, slots, False)
        held = ["min_tokens" in slot_parts(seq) for seq in seqs]
        self._put(self.stop_mask, [(seq.slot, t) for seq, h in zip(seqs, held) if h for t in seq.stop_ids], True)
        ends = [seq.num_prompt_tokens + seq.params.min_tokens if h else 0 for seq, h in zip(seqs, held)]
        self.min_end.index_copy_(0, slots, self._ids(ends))

    def _admit_penalties(self, seqs, slots: torch.Tensor) -> None:
        self.counts.index_fill_(0, slots, 0.0)
        self.prompt_mask.index_fill_(0, slots, False)
        self._put(self.counts, [(seq.slot, t) for seq in seqs for t in seq.generated_ids], 1.0, accumulate=True)
        self._put(self.prompt_mask, [(seq.slot, t) for seq in seqs
                                     for t in seq.token_ids[:seq.num_prompt_tokens]], True)
        params = torch.tensor([[seq.params.repetition_penalty, seq.params.frequency_penalty,
                                seq.params.presence_penalty] for seq in seqs], dtype=torch.float32)
        self.penalty_params.index_copy_(1, slots, params.T.contiguous().to(self.device))

    def step_tensors(self, slots: torch.Tensor, parts: tuple[str, ...]) -> tuple:
        """`process_logits`' state arguments for a step applying `parts` (None: not applied)."""
        use_bias, use_bad, use_min, use_pen = (part in parts for part in SLOT_PARTS)
        return (slots, self.bias if use_bias else None,
                (self.bad_prefixes, self.bad_last, self.history) if use_bad else None,
                self.stop_mask if use_min else None, self.min_end if use_min else None,
                self.penalty_params if use_pen else None, self.counts if use_pen else None,
                self.prompt_mask if use_pen else None)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor, parts: tuple[str, ...]) -> None:
        """What a step applying `parts` writes after drawing `token_ids`: the penalty counts and
        the bad-word histories of its rows' slots. Capturable (padding rows write slot 0)."""
        if "penalties" in parts:
            self.count(slots, token_ids)
        if "bad_words" in parts:
            self.history[slots] = torch.cat([self.history[slots, 1:], token_ids[:, None]], dim=1)

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add each drawn token to its slot's counts. Atomic adds of integers: exact, in any
        order, and capturable."""
        flat = slots * self.vocab + token_ids
        self.counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, device=flat.device))


def build_sampling_tensors(seqs, vocab: int, slot_state: SlotSampling | None = None) -> SamplingTensors:
    """Per-row settings of the sequences about to draw their next token, as host tensors. Rows
    using processors need `slot_state`, their rows written by `SlotSampling.admit`."""
    params = [s.params for s in seqs]
    top_k = [p.top_k if p.top_k and p.top_k > 0 else vocab for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    temperature = [float(p.temperature) for p in params]
    need_truncation = any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(min_p)
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    processors = step_parts(seqs)
    if processors and slot_state is None:
        raise ValueError(f"rows use logits processors {processors} but no slot state was given")
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32),
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64),
        counters=torch.tensor([s.num_tokens_with_pending for s in seqs], dtype=torch.int64),
        need_truncation=need_truncation,
        all_greedy=all(t == 0 for t in temperature),
        max_logprobs=max((vocab if k == -1 else k for k in logprob_ks), default=-1),
        slots=torch.tensor([s.slot for s in seqs], dtype=torch.int64),
        processors=processors,
        slot_state=slot_state,
    )


_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "counters", "slots")


def sampling_to_device(st: SamplingTensors, device: torch.device) -> SamplingTensors:
    """Move host sampling tensors to the device: per-row vectors in one packed transfer."""
    if device.type == "cpu":
        return st
    packed = pack_rows([getattr(st, f) for f in _ROW_FIELDS]).to(device, non_blocking=True)
    moved = {f: unpack_row(packed[i], getattr(st, f).dtype) for i, f in enumerate(_ROW_FIELDS)}
    return SamplingTensors(**moved, need_truncation=st.need_truncation,
                           all_greedy=st.all_greedy, max_logprobs=st.max_logprobs,
                           processors=st.processors, slot_state=st.slot_state)


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
