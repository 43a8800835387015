"""Per-sequence state: one prompt sample being generated."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"        # no slot; (re)prefill pending
    RUNNING = "running"        # holds a slot and pages
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_index: int                 # position of its request in the generate() call
    sample_index: int                  # 0..n-1 within the request
    token_ids: list[int]               # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int                    # generation limit after capping at max_model_len
    seed: int                          # sampling seed (per sample; see sampler)
    stop_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    slot: int = 0
    num_computed: int = 0              # tokens whose KV is in the cache
    num_cached: int = 0                # prompt tokens whose KV was reused, not computed
    # Tokens sampled by a launched decode step whose result the host has not read yet (async
    # decode). 0 or 1 when a step is scheduled; positions, pages and counters count them.
    num_pending: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float = 0.0
    text: str = ""                     # detokenized output, kept only when stop strings need it
    bad_words_ids: list[list[int]] = field(default_factory=list)
    detok_offsets: tuple[int, int] = (0, 0)   # slow-tokenizer detokenizer's (prefix, read) offsets
    detok_stream: object | None = field(default=None, repr=False)   # tokenizers' DecodeStream
    detok_fed: int = 0                 # generated tokens the DecodeStream has seen
    lora: object | None = None         # the Adapter a LoRARequest named, or None
    share_with: Sequence | None = field(default=None, repr=False)   # group leader whose prompt KV it reuses

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def length_exhausted(self) -> bool:
        """Its pending token is its last (max_tokens is already capped at max_model_len)."""
        return self.num_generated + self.num_pending >= self.max_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def in_prefill(self) -> bool:
        """True until every known token (prompt, and generated ones after a preemption) is cached."""
        return self.num_computed < self.num_tokens - 1 or self.num_computed == 0

    @property
    def one_token_bad_words(self) -> list[int]:
        """Bad words of one token: banned at every step (a static ban)."""
        return [word[0] for word in self.bad_words_ids if len(word) == 1]

    @property
    def multi_token_bad_words(self) -> list[list[int]]:
        return [word for word in self.bad_words_ids if len(word) > 1]
