"""Sampling parameters with vLLM's offline-API signature and validation.

Clients written for vLLM (TRL, Unsloth, notebooks) build ``SamplingParams``
exactly as they would for vLLM, and Unsloth filters its keyword arguments
through ``inspect.signature(SamplingParams)``.  The constructor is therefore a
plain, explicit, keyword-only ``__init__`` (no ``**kwargs``: an unknown
argument raises ``TypeError`` like any Python call).

Validation follows vLLM's ``_verify_args``: a bad value raises ``ValueError``,
a value of the wrong type raises ``TypeError``, and a feature this engine does
not implement raises ``NotImplementedError``; every message starts with the
parameter's name.

Normalisations done in ``__init__`` that the engine may rely on:

* ``temperature`` is a float; ``0 < temperature < 0.01`` is raised to 0.01
  (vLLM does the same, to keep logits finite).  Greedy decoding is exactly
  ``temperature == 0.0`` (see ``is_greedy`` / ``sampling_type``); it forces
  ``top_p = 1.0``, ``top_k = 0``, ``min_p = 0.0`` and requires ``n == 1``.
* ``top_k``: ``0`` and ``-1`` both mean "off"; ``-1`` is stored as ``0``, so
  ``top_k > 0`` is the only test needed.
* ``max_tokens=None`` means "up to the model's context length"; the engine
  resolves it per prompt (``max_model_len - len(prompt)``).
* ``stop`` / ``stop_token_ids`` / ``bad_words`` are always lists (never None);
  ``stop_token_ids`` and ``bad_words`` are de-duplicated in order.
* ``seed=-1`` becomes ``None``.  ``best_of=None`` becomes ``n``.
* ``logprobs`` / ``prompt_logprobs``: ``None`` (off), ``k >= 0`` (top-k plus
  the sampled / prompt token) or ``-1`` (whole vocabulary, resolved by the
  engine).  ``True`` becomes 1 (as in vLLM), ``False`` becomes ``None``.
* ``logit_bias`` is ``None`` or ``dict[int, float]`` (string keys from JSON
  are converted).
* ``output_kind``, ``flat_logprobs``, ``stream_interval`` and ``skip_clone``
  are accepted for compatibility and do not change the offline result
  (a list of ``dict[int, Logprob]`` duck-types vLLM's flat logprobs).
* ``skip_reading_prefix_cache`` (default: on exactly when ``prompt_logprobs``
  is asked for) keeps the request out of shared prefills: its prompt is
  computed on its own, for each of its ``n`` samples.
* EOS ids are not kept here: the engine reads them from the tokenizer and the
  model's generation config (vLLM's ``update_from_generation_config``, its
  ``all_stop_token_ids`` and ``output_text_buffer_length`` serve its
  streaming engine and are left out).
* ``spaces_between_special_tokens`` is validated and ignored: transformers 5's
  tokenizers (fast and sentencepiece alike) accept it in ``decode`` and do not
  read it, so there is nothing to pass it to.
"""

from __future__ import annotations

import copy
import enum
import inspect
import logging
import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (after the clamp below only 0.0 is)."""

_MIN_TEMPERATURE = 1e-2
"""Smallest non-zero temperature; smaller values overflow logits / T."""


class SamplingType(enum.IntEnum):
    """How a request draws tokens; mirrors vLLM's enum of the same name."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """vLLM's streaming modes; offline generation always returns final outputs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """Import-compatible stand-in: structured outputs are not implemented.

    It exists so that ``from ...sampling_params import StructuredOutputsParams``
    works in client code; passing one to ``SamplingParams`` raises
    ``NotImplementedError``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """Import-compatible stand-in for vLLM's deprecated guided decoding params."""

    backend: str | None = None
    disable_fallback: bool = False


# --------------------------------------------------------------------------
# Type coercion helpers. Each names the parameter in its error message.
# --------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return type(value).__name__


def _as_int(name: str, value: Any) -> int:
    """Accept Python / numpy / torch integers; reject bool and float (vLLM-strict)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {_type_name(value)} ({value!r})") from None


def _as_optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _as_int(name, value)


def _as_float(name: str, value: Any) -> float:
    """Accept any real number except bool, so ``temperature="hot"`` fails loudly."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_type_name(value)} ({value!r})")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    """Accept bools and the integers 0 / 1 (common in configs)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {_type_name(value)} ({value!r})")


def _as_str_list(name: str, value: Any) -> list[str]:
    """None -> [], str -> [str], list/tuple of str -> list; empty strings rejected."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str, got {_type_name(value)}")
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{name} must contain only str, got {_type_name(item)} ({item!r})")
        if not item:
            raise ValueError(f"{name} cannot contain an empty string, got {list(items)!r}")
    return list(items)


def _as_token_ids(name: str, value: Any) -> list[int]:
    """None -> [], list/tuple of non-negative ints -> list[int]."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of int, got {_type_name(value)} ({value!r})")
    ids = [_as_int(name, item) for item in value]
    negative = [i for i in ids if i < 0]
    if negative:
        raise ValueError(f"{name} must contain non-negative token ids, got {negative}")
    return ids


def _dedup(items: list[Any]) -> list[Any]:
    """Order-preserving de-duplication (vLLM does this for stop ids and bad words)."""
    return list(dict.fromkeys(items))


def _as_logprob_count(name: str, value: Any) -> int | None:
    """None / k >= 0 / -1 (whole vocab); True means 1 as in vLLM, False means off."""
    if value is None or value is False:
        return None
    if value is True:
        return 1
    count = _as_int(name, value)
    if count < -1:
        raise ValueError(f"{name} must be non-negative or -1, got {count}.")
    return count


def _bias_key(key: Any) -> int:
    """Token id keys may arrive as digit strings from JSON payloads."""
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not an integer token id") from None
    return _as_int("logit_bias key", key)


def _as_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias must be a dict[int, float], got {_type_name(value)}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        token_id = _bias_key(key)
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
        amount = _as_float(f"logit_bias[{key!r}]", raw)
        if math.isnan(amount) or amount == math.inf:
            # -inf is the usual "ban this token"; +inf or NaN would turn softmax into NaN.
            raise ValueError(f"logit_bias[{key!r}] must be a number below +inf, got {amount}")
        bias[token_id] = amount
    return bias


def _reject_if_set(name: str, value: Any, what: str) -> None:
    if value is not None:
        raise NotImplementedError(f"{name} is not supported by flexrollout ({what}); got {value!r}")


class SamplingParams:
    """Per-request sampling settings, mirroring ``vllm.SamplingParams``.

    Construct with keyword arguments only; see the module docstring for the
    normalisations applied.  Attributes are plain and may be reassigned by
    callers (as with vLLM) but are not re-validated when they are.
    """

    def __init__(
        self,
        *,
        n: int = 1,
        best_of: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        bad_words: list[str] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        guided_decoding: GuidedDecodingParams | None = None,
        extra_args: dict[str, Any] | None = None,
        output_kind: RequestOutputKind | None = RequestOutputKind.CUMULATIVE,
        logits_processors: list[Any] | None = None,
        flat_logprobs: bool = False,
        stream_interval: int | None = None,
        skip_clone: bool = False,
        skip_reading_prefix_cache: bool | None = None,
    ) -> None:
        self._set_count(n, best_of)
        self._set_penalties(presence_penalty, frequency_penalty, repetition_penalty)
        self._set_filters(temperature, top_p, top_k, min_p)
        self.seed = _as_optional_int("seed", seed)
        if self.seed == -1:
            self.seed = None
        self._set_stopping(stop, stop_token_ids, bad_words, ignore_eos, max_tokens, min_tokens)
        self.logprobs = _as_logprob_count("logprobs", logprobs)
        self.prompt_logprobs = _as_logprob_count("prompt_logprobs", prompt_logprobs)
        self._set_detokenization(
            detokenize, skip_special_tokens, spaces_between_special_tokens, include_stop_str_in_output
        )
        self._set_token_constraints(logit_bias, allowed_token_ids, truncate_prompt_tokens)
        self._reject_unsupported(
            structured_outputs=structured_outputs,
            guided_decoding=guided_decoding,
            logits_processors=logits_processors,
        )
        self._set_passthrough(extra_args, output_kind, flat_logprobs, stream_interval, skip_clone)
        self.skip_reading_prefix_cache = (
            self.prompt_logprobs is not None
            if skip_reading_prefix_cache is None
            else _as_bool("skip_reading_prefix_cache", skip_reading_prefix_cache)
        )
        self._set_internal_state()
        if self.is_greedy:
            self._normalise_greedy()

    # ------------------------------------------------------------------ setup

    def _set_count(self, n: Any, best_of: Any) -> None:
        self.n = _as_int("n", n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        best = _as_optional_int("best_of", best_of)
        if best is not None and best < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={best}.")
        if best is not None and best > self.n:
            raise NotImplementedError(f"best_of > n is not supported (as in vLLM V1); got best_of={best}, n={self.n}.")
        self.best_of = self.n

    def _set_penalties(self, presence: Any, frequency: Any, repetition: Any) -> None:
        self.presence_penalty = _as_float("presence_penalty", presence)
        self.frequency_penalty = _as_float("frequency_penalty", frequency)
        self.repetition_penalty = _as_float("repetition_penalty", repetition)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")

    def _set_filters(self, temperature: Any, top_p: Any, top_k: Any, min_p: Any) -> None:
        self.temperature = self._checked_temperature(_as_float("temperature", temperature))
        self.top_p = _as_float("top_p", top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        self.top_k = _as_int("top_k", top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _as_float("min_p", min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")

    @staticmethod
    def _checked_temperature(value: float) -> float:
        """Validate and clamp tiny positive temperatures the way vLLM does."""
        if not math.isfinite(value):
            raise ValueError(f"temperature must be a finite number, got {value}.")
        if value < 0.0:
            raise ValueError(f"temperature must be non-negative, got {value}.")
        if 0.0 < value < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may produce nan or inf; using %s.",
                value, _MIN_TEMPERATURE, _MIN_TEMPERATURE,
            )
            return _MIN_TEMPERATURE
        return value

    def _set_stopping(
        self, stop: Any, stop_token_ids: Any, bad_words: Any, ignore_eos: Any, max_tokens: Any, min_tokens: Any
    ) -> None:
        self.stop = _as_str_list("stop", stop)
        self.stop_token_ids = _dedup(_as_token_ids("stop_token_ids", stop_token_ids))
        self.bad_words = _dedup(_as_str_list("bad_words", bad_words))
        self.ignore_eos = _as_bool("ignore_eos", ignore_eos)
        self.max_tokens = _as_optional_int("max_tokens", max_tokens)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        self.min_tokens = _as_int("min_tokens", min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )

    def _set_detokenization(
        self, detokenize: Any, skip_special: Any, spaces_between: Any, include_stop_str: Any
    ) -> None:
        self.detokenize = _as_bool("detokenize", detokenize)
        self.skip_special_tokens = _as_bool("skip_special_tokens", skip_special)
        self.spaces_between_special_tokens = _as_bool("spaces_between_special_tokens", spaces_between)
        self.include_stop_str_in_output = _as_bool("include_stop_str_in_output", include_stop_str)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")

    def _set_token_constraints(self, logit_bias: Any, allowed_token_ids: Any, truncate: Any) -> None:
        self.logit_bias = _as_logit_bias(logit_bias)
        if allowed_token_ids is None:
            self.allowed_token_ids = None
        else:
            self.allowed_token_ids = _as_token_ids("allowed_token_ids", allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list, got [].")
        self.truncate_prompt_tokens = _as_optional_int("truncate_prompt_tokens", truncate)
        value = self.truncate_prompt_tokens
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1 (model's max length), got {value}")

    @staticmethod
    def _reject_unsupported(structured_outputs: Any, guided_decoding: Any, logits_processors: Any) -> None:
        """Refuse features the engine lacks rather than silently ignoring them.

        vLLM's newer unsupported fields (``logprob_token_ids``,
        ``thinking_token_budget``, ...) are left out of the signature on
        purpose: clients probe ``inspect.signature`` to detect features.
        """
        _reject_if_set("structured_outputs", structured_outputs, "no constrained decoding")
        _reject_if_set("guided_decoding", guided_decoding, "no constrained decoding")
        # An empty list is a harmless "no processors"; anything else would be silently ignored.
        if logits_processors is not None and not (isinstance(logits_processors, (list, tuple)) and not logits_processors):
            raise NotImplementedError(
                f"logits_processors is not supported by flexrollout (vLLM V1 dropped per-request processors); "
                f"got {logits_processors!r}"
            )

    def _set_passthrough(
        self, extra_args: Any, output_kind: Any, flat_logprobs: Any, stream_interval: Any, skip_clone: Any
    ) -> None:
        """Fields kept for API compatibility; they do not change offline results."""
        if extra_args is not None and not isinstance(extra_args, Mapping):
            raise TypeError(f"extra_args must be a dict or None, got {_type_name(extra_args)}")
        self.extra_args = None if extra_args is None else dict(extra_args)
        self.output_kind = output_kind
        self.flat_logprobs = _as_bool("flat_logprobs", flat_logprobs)
        self.stream_interval = _as_optional_int("stream_interval", stream_interval)
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        self.skip_clone = _as_bool("skip_clone", skip_clone)
        # Accepted and always None: the constructor refuses any other value.
        self.structured_outputs = None
        self.guided_decoding = None
        self.logits_processors = None

    def _set_internal_state(self) -> None:
        """State vLLM keeps beside the user fields; filled in by `update_from_tokenizer`."""
        self._bad_words_token_ids: list[list[int]] | None = None

    def _normalise_greedy(self) -> None:
        """Greedy ignores the filters; vLLM resets them and forbids n > 1."""
        self.top_p = 1.0
        self.top_k = 0
        self.min_p = 0.0
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    # ------------------------------------------------------------- queries

    @property
    def is_greedy(self) -> bool:
        """True when the request picks the argmax (temperature == 0)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token sequences of ``bad_words``; filled by ``update_from_tokenizer``."""
        return self._bad_words_token_ids

    # ------------------------------------------------------- engine hooks

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenise ``bad_words`` both word-initial and mid-text (with a leading space)."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise ValueError(f"bad_words entry {word!r} must tokenize to at least one token.")
            sequences.append(bare)
            # Keep the spaced form only when it is a genuinely different last token.
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    # ------------------------------------------------------------ copying

    def clone(self) -> SamplingParams:
        """Independent copy; shallow if ``skip_clone``."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like vLLM's

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _REPR_FIELDS)
        return f"SamplingParams({fields})"


_REPR_FIELDS: tuple[str, ...] = tuple(
    name
    for name in inspect.signature(SamplingParams.__init__).parameters
    if name != "self"
)
