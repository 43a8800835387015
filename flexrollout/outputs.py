"""Result objects with vLLM's field names, order and types.

Clients index these exactly as they index vLLM's
(``llm.generate(...)[0].outputs[0].text``, ``.token_ids``, ``.logprobs``),
so the classes are plain dataclasses (no slots: clients may set attributes).

Logprob layout (same as vLLM's non-flat mode):

* ``CompletionOutput.logprobs`` is ``None`` unless ``SamplingParams.logprobs``
  was set; otherwise one ``dict[int, Logprob]`` per generated token, holding
  the top-k tokens plus the sampled token (so up to k + 1 entries).
* ``RequestOutput.prompt_logprobs`` is ``None`` unless ``prompt_logprobs`` was
  set; otherwise one entry per prompt token, the first being ``None`` (the
  first token has no context to be predicted from).

Built here too: `request_output` (a finished request from its engine sequences) and, for
flexrollout's streaming extension `LLM.generate_stream`, `TokenDelta`s (`DeltaStream`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from .engine.logprobs import Logprob

if TYPE_CHECKING:
    from flexrollout.engine.sequence import Sequence
    from flexrollout.lora_request import LoRARequest
    from flexrollout.requests import Request

logger = logging.getLogger(__name__)


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token."""

PromptLogprobs = list[Union[dict[int, Logprob], None]]
"""One entry per prompt token; the first is None."""


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are ``n`` per request).

    ``finish_reason`` is ``"stop"`` (EOS, stop token or stop string) or
    ``"length"`` (``max_tokens`` / context length).  ``stop_reason`` is the
    stop string or stop token id that ended it, or ``None`` for EOS / length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one prompt; positional order matches vLLM's ``__init__``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any | None = None
    lora_request: LoRARequest | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None

    @property
    def kv_transfer_params(self) -> None:
        """vLLM's disaggregated-serving hook; never used offline."""
        return None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, lora_request={self.lora_request}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


def request_output(request: Request, seqs: list[Sequence]) -> RequestOutput:
    """A finished request's output, built from its engine sequences (one per sample)."""
    completions = [CompletionOutput(
        index=s.sample_index, text=s.text, token_ids=s.generated_ids,
        cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
        logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
        lora_request=request.lora_request) for s in seqs]
    return RequestOutput(
        request_id=str(seqs[0].seq_id), prompt=request.prompt.text,
        prompt_token_ids=request.prompt.token_ids, prompt_logprobs=seqs[0].prompt_logprobs,
        outputs=completions, finished=True, lora_request=request.lora_request,
        num_cached_tokens=max(s.num_cached for s in seqs))


@dataclass
class TokenDelta:
    """What one sample added since its previous delta: `LLM.generate_stream`'s items (a
    flexrollout extension; vLLM's offline `LLM` does not stream)."""

    request_index: int                      # the prompt's position in the call
    index: int                              # the sample (`CompletionOutput.index`)
    token_ids: list[int]                    # tokens generated since the previous delta
    text: str                               # the text they add; may lag behind them (see DeltaStream)
    finish_reason: str | None = None        # "stop" | "length" on the sample's last delta
    output: RequestOutput | None = None     # the request's output, on the delta ending its last sample


class DeltaStream:
    """A streamed call's `TokenDelta`s, read from its sequences between engine steps.

    A sample's text so far is the tokenizer's decode of its tokens, the rule of its final text, so
    the deltas' texts join to `CompletionOutput.text`. Held back until later: an incomplete UTF-8
    character, and the last len(longest stop string) - 1 characters (the start of a stop string
    that is cut from the output when it completes). One exception: an output ended by a stop
    string keeps the engine's incremental text, decoded after the prompt's last tokens; for
    tokenizers whose decode depends on that context (SentencePiece / WordPiece: a leading space)
    it differs from the decode, and a warning says the request's output holds the text.
    Byte-level BPE tokenizers (Llama-3, Qwen, SmolLM2) decode the same both ways. Each step
    re-decodes a sample from its first token (cost grows with its length): streaming is meant
    for interactive use, not for rollouts.
    """

    def __init__(self, requests: list[Request], per_request: list[list[Sequence]], tokenizer) -> None:
        self._requests = requests
        self._per_request = per_request
        self._tokenizer = tokenizer
        self._sent: dict[int, tuple[int, str]] = {}      # seq_id -> (tokens, text) delivered
        self._unfinished = [len(seqs) for seqs in per_request]

    def deltas(self) -> list[TokenDelta]:
        out = []
        for request, seqs in zip(self._requests, self._per_request):
            for seq in seqs:
                delta = self._delta(seq)
                if delta is None:
                    continue
                out.append(delta)
                if delta.finish_reason is not None:
                    self._unfinished[request.index] -= 1
                    if self._unfinished[request.index] == 0:
                        delta.output = request_output(request, seqs)
        return out

    def _delta(self, seq: Sequence) -> TokenDelta | None:
        tokens, text = self._sent.get(seq.seq_id, (0, ""))
        if tokens < 0:                                   # its last delta went out already
            return None
        new_ids = seq.generated_ids[tokens:]
        finished = seq.finish_reason is not None
        if not new_ids and not finished:
            return None
        current = seq.text if finished else self._visible_text(seq)
        if current.startswith(text):
            piece = current[len(text):]
        else:
            # Only a tokenizer whose decode of a longer output rewrites earlier text gets here.
            logger.warning("streamed text of sequence %d is not a prefix of its text %r; the "
                           "request's output holds the text", seq.seq_id, current)
            piece = ""
        self._sent[seq.seq_id] = (-1, "") if finished else (tokens + len(new_ids), text + piece)
        return TokenDelta(seq.request_index, seq.sample_index, new_ids, piece, seq.finish_reason)

    def _visible_text(self, seq: Sequence) -> str:
        if self._tokenizer is None or not seq.params.detokenize:
            return ""
        text = self._tokenizer.decode(seq.generated_ids, skip_special_tokens=seq.params.skip_special_tokens)
        text = text.rstrip("\ufffd")                     # an incomplete character waits for its bytes
        hold = max((len(s) for s in seq.params.stop or ()), default=1) - 1
        return text[:max(0, len(text) - hold)]
