"""Input processing: a generate call's arguments -> checked `Request`s -> engine `Sequence`s.

Everything a call could reject is checked here, for every prompt, before the engine does any
work (tests/test_bad_inputs.py). Prompt forms are parsed in prompts.py; outputs are built in
outputs.py.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import count

from .engine.sequence import Sequence
from .lora_request import LoRARequest
from .prompts import Prompt, check_tokens, split_prompts, to_prompt
from .sampling_params import SamplingParams


@dataclass
class Request:
    """One prompt of a call, parsed and checked; it becomes `params.n` engine sequences."""

    index: int                      # position in the call: outputs come back in this order
    prompt: Prompt                  # token ids (truncated as `truncate_prompt_tokens` asks) and text
    params: SamplingParams
    max_tokens: int                 # params.max_tokens capped at what max_model_len leaves
    adapter: object | None = None   # the Adapter a LoRARequest named; None: the model's own LoRA
    lora_request: LoRARequest | None = None     # as given, echoed in the outputs as vLLM does


def parse_requests(prompts, sampling_params, lora_request, engine, tokenizer,
                   load_adapters) -> list[Request]:
    """Every prompt parsed and checked, then the adapters loaded: `load_adapters` maps the list
    of each row's LoRARequest (or None), types already checked, to their Adapters (or None)."""
    items = split_prompts(prompts)
    params = params_list(sampling_params, len(items))
    parsed = [to_prompt(p, tokenizer, i) for i, p in enumerate(items)]
    requests = [make_request(i, prompt, sp, engine, tokenizer)
                for i, (prompt, sp) in enumerate(zip(parsed, params))]
    per_row = lora_requests(lora_request, len(items))
    for request, given, adapter in zip(requests, per_row, load_adapters(per_row)):
        request.lora_request, request.adapter = given, adapter
    return requests


def params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: vLLM takes None, one for all, or a list of the same length."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{num_prompts} prompts; pass one or one per prompt")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                    f"got {type(sampling_params).__name__}")


def lora_requests(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt, every entry's type checked before any is loaded."""
    if lora_request is None:
        return [None] * num_prompts
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, "
                        f"got {type(lora_request).__name__}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
    for i, req in enumerate(lora_request):
        if req is not None and not isinstance(req, LoRARequest):
            raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got {type(req).__name__}")
    return list(lora_request)


def make_request(index: int, prompt: Prompt, params: SamplingParams, engine, tokenizer) -> Request:
    """Check one prompt and its SamplingParams against the model and the cache."""
    vocab = engine.spec.vocab_size
    truncate = params.truncate_prompt_tokens
    if truncate is not None:
        keep = engine.max_model_len if truncate == -1 else truncate
        prompt.token_ids = prompt.token_ids[-keep:]
    check_tokens(prompt, vocab, engine.max_model_len, index)
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad = [t for t in getattr(params, name) or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sampling_params.{name} has ids outside [0, {vocab}): {bad[:5]}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab:
            raise ValueError(f"sampling_params.{name}={k} exceeds the vocabulary size {vocab} "
                             f"(use -1 for all tokens)")
    bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"sampling_params.logit_bias has ids outside [0, {vocab}): {bad[:5]}")
    room = engine.max_model_len - len(prompt.token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    needed = len(prompt.token_ids) + max_tokens
    if needed > engine.capacity_tokens:
        raise ValueError(
            f"prompts[{index}] needs {needed} KV tokens (prompt {len(prompt.token_ids)} + "
            f"max_tokens {max_tokens}) but the cache holds {engine.capacity_tokens}; lower "
            f"max_tokens or raise num_kv_pages / gpu_memory_utilization")
    if params.stop and tokenizer is None:
        raise ValueError("sampling_params.stop needs a tokenizer")
    return Request(index, prompt, params, max_tokens)


class SequenceMaker:
    """Turns requests into engine sequences: ids unique over the LLM's life, per-sample seeds."""

    def __init__(self, seed: int, eos_ids: frozenset[int]) -> None:
        self.eos_ids = eos_ids
        self._rng = random.Random(seed)      # seeds of samples whose params give none
        self._ids = count()

    def sequences(self, request: Request, tokenizer) -> list[Sequence]:
        params = request.params
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        bad_words = _bad_words(params, tokenizer)
        seqs = []
        for sample in range(params.n):
            if params.seed is not None:
                seed = (params.seed + sample * 0x9E3779B97F4A7C15) % (1 << 63)
            else:
                seed = self._rng.getrandbits(63)
            seqs.append(Sequence(
                seq_id=next(self._ids), request_index=request.index, sample_index=sample,
                token_ids=list(request.prompt.token_ids), num_prompt_tokens=len(request.prompt.token_ids),
                params=params, max_tokens=request.max_tokens, seed=seed,
                stop_ids=frozenset(stop_ids), bad_words_ids=bad_words, lora=request.adapter))
        return seqs


def _bad_words(params: SamplingParams, tokenizer) -> list[list[int]]:
    if not params.bad_words:
        return []
    copy = params.clone()
    copy.update_from_tokenizer(tokenizer)
    return [list(w) for w in copy.bad_words_token_ids or []]


def prefill_groups(per_request: list[list[Sequence]], prefix_caching: bool) -> list[list[Sequence]]:
    """Samples of one prompt, and identical prompts in this call, share one prefill."""
    if not prefix_caching:
        return [[s] for seqs in per_request for s in seqs]
    groups: dict[tuple, list[Sequence]] = {}
    for seqs in per_request:
        for seq in seqs:
            # A request that skips reading shared prompt KV (by default, one asking for
            # prompt_logprobs, which only a group's leader computes) stays alone.
            lora_id = seq.lora.lora_int_id if seq.lora is not None else 0
            key = ((seq.seq_id,) if seq.params.skip_reading_prefix_cache
                   else (lora_id, tuple(seq.token_ids)))
            groups.setdefault(key, []).append(seq)
    return list(groups.values())
