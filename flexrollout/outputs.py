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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from flexrollout.engine.sequence import Sequence
    from flexrollout.lora_request import LoRARequest
    from flexrollout.requests import Request


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
        logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
        for s in seqs]
    return RequestOutput(
        request_id=str(seqs[0].seq_id), prompt=request.prompt.text,
        prompt_token_ids=request.prompt.token_ids, prompt_logprobs=seqs[0].prompt_logprobs,
        outputs=completions, finished=True, num_cached_tokens=max(s.num_cached for s in seqs))
