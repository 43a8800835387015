"""Contract tests for SamplingParams, the output dataclasses and LoRARequest.

These objects are the part of vLLM's API that TRL / Unsloth touch most
directly, so signature, defaults and validation errors are pinned here.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest

from flexrollout.lora_request import LoRARequest
from flexrollout.outputs import CompletionOutput, Logprob, RequestOutput
from flexrollout.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

# ---------------------------------------------------------------- signature

VLLM_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "bad_words": None,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "logit_bias": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "structured_outputs": None,
    "guided_decoding": None,
    "extra_args": None,
    "output_kind": RequestOutputKind.CUMULATIVE,
    "logits_processors": None,
    "flat_logprobs": False,
}


def test_signature_has_vllm_names_and_defaults() -> None:
    params = inspect.signature(SamplingParams).parameters
    for name, default in VLLM_DEFAULTS.items():
        assert name in params, name
        assert params[name].default == default, name


def test_signature_has_no_var_kwargs() -> None:
    kinds = {p.kind for p in inspect.signature(SamplingParams).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert inspect.Parameter.VAR_POSITIONAL not in kinds


def test_unsloth_style_kwarg_filtering() -> None:
    """Unsloth keeps only the kwargs that the signature names."""
    wanted = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 64, "not_a_vllm_arg": 3}
    names = inspect.signature(SamplingParams).parameters
    sp = SamplingParams(**{k: v for k, v in wanted.items() if k in names})
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.8, 0.95, 64)


@pytest.mark.parametrize("name", ["logprob_token_ids", "thinking_token_budget", "trace_decode_token_ids"])
def test_unsupported_newer_fields_not_advertised(name: str) -> None:
    """Clients probe the signature for features; only list what works."""
    assert name not in inspect.signature(SamplingParams).parameters
    with pytest.raises(TypeError):
        SamplingParams(**{name: None})


def test_unknown_kwarg_raises_type_error() -> None:
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_positional_args_rejected() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


# ---------------------------------------------------------------- defaults


def test_defaults_after_normalisation() -> None:
    sp = SamplingParams()
    assert sp.n == 1 and sp.best_of == 1
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == 0 and sp.min_p == 0.0
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.bad_words == []
    assert sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.logprobs is None and sp.prompt_logprobs is None
    assert sp.logit_bias is None and sp.allowed_token_ids is None
    assert sp.sampling_type is SamplingType.RANDOM and not sp.is_greedy
    assert sp.skip_reading_prefix_cache is False


# ------------------------------------------------------------ invalid values

INVALID_VALUES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"n": 0}, ValueError, "n"),
    ({"n": -3}, ValueError, "n"),
    ({"n": 1.5}, TypeError, "n"),
    ({"n": 2.0}, TypeError, "n"),
    ({"n": True}, TypeError, "n"),
    ({"n": "2"}, TypeError, "n"),
    ({"n": 2, "best_of": 1}, ValueError, "best_of"),
    ({"n": 1, "best_of": 4}, NotImplementedError, "best_of"),
    ({"best_of": 1.0}, TypeError, "best_of"),
    ({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
    ({"presence_penalty": -2.01}, ValueError, "presence_penalty"),
    ({"presence_penalty": "x"}, TypeError, "presence_penalty"),
    ({"frequency_penalty": 3}, ValueError, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, ValueError, "frequency_penalty"),
    ({"frequency_penalty": None}, TypeError, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, ValueError, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty"),
    ({"repetition_penalty": False}, TypeError, "repetition_penalty"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"temperature": None}, TypeError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.01}, ValueError, "top_p"),
    ({"top_p": -0.5}, ValueError, "top_p"),
    ({"top_p": "1"}, TypeError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"top_k": 5.0}, TypeError, "top_k"),
    ({"top_k": True}, TypeError, "top_k"),
    ({"min_p": -0.1}, ValueError, "min_p"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"min_p": [0.1]}, TypeError, "min_p"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"seed": "42"}, TypeError, "seed"),
    ({"stop": 5}, TypeError, "stop"),
    ({"stop": ["ok", 5]}, TypeError, "stop"),
    ({"stop": ""}, ValueError, "stop"),
    ({"stop": ["a", ""]}, ValueError, "stop"),
    ({"stop": "x", "detokenize": False}, ValueError, "stop"),
    ({"stop_token_ids": 7}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [1, 2.0]}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids"),
    ({"bad_words": [""]}, ValueError, "bad_words"),
    ({"bad_words": [3]}, TypeError, "bad_words"),
    ({"bad_words": 3}, TypeError, "bad_words"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ({"ignore_eos": 2}, TypeError, "ignore_eos"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_tokens": -5}, ValueError, "max_tokens"),
    ({"max_tokens": 10.0}, TypeError, "max_tokens"),
    ({"max_tokens": "10"}, TypeError, "max_tokens"),
    ({"min_tokens": -1}, ValueError, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, ValueError, "min_tokens"),
    ({"min_tokens": 1.0}, TypeError, "min_tokens"),
    ({"logprobs": -2}, ValueError, "logprobs"),
    ({"logprobs": 1.5}, TypeError, "logprobs"),
    ({"logprobs": "5"}, TypeError, "logprobs"),
    ({"prompt_logprobs": -2}, ValueError, "prompt_logprobs"),
    ({"prompt_logprobs": 0.5}, TypeError, "prompt_logprobs"),
    ({"detokenize": "no"}, TypeError, "detokenize"),
    ({"skip_special_tokens": None}, TypeError, "skip_special_tokens"),
    ({"spaces_between_special_tokens": "a"}, TypeError, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": 3}, TypeError, "include_stop_str_in_output"),
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias"),
    ({"logit_bias": {1: "big"}}, TypeError, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, ValueError, "logit_bias"),
    ({"logit_bias": {1: float("inf")}}, ValueError, "logit_bias"),
    ({"allowed_token_ids": []}, ValueError, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, TypeError, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, ValueError, "allowed_token_ids"),
    ({"allowed_token_ids": ["1"]}, TypeError, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, ValueError, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, ValueError, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.0}, TypeError, "truncate_prompt_tokens"),
    ({"structured_outputs": StructuredOutputsParams(regex="a+")}, NotImplementedError, "structured_outputs"),
    ({"guided_decoding": GuidedDecodingParams(regex="a+")}, NotImplementedError, "guided_decoding"),
    ({"guided_decoding": {"regex": "a+"}}, NotImplementedError, "guided_decoding"),
    ({"logits_processors": [lambda ids, logits: logits]}, NotImplementedError, "logits_processors"),
    ({"extra_args": [1]}, TypeError, "extra_args"),
    ({"flat_logprobs": "yes"}, TypeError, "flat_logprobs"),
    ({"stream_interval": 0}, ValueError, "stream_interval"),
    ({"skip_clone": "no"}, TypeError, "skip_clone"),
    ({"temperature": 0.0, "n": 4}, ValueError, "n"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), INVALID_VALUES, ids=lambda v: repr(v)[:40])
def test_invalid_values_raise_with_parameter_name(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    assert type(info.value) is error
    assert name in str(info.value)


def test_temperature_message_matches_vllm() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be non-negative, got -1.0"):
        SamplingParams(temperature=-1.0)


# ------------------------------------------------------------ valid values


def test_stop_string_becomes_list() -> None:
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_token_ids_and_bad_words_deduplicated_in_order() -> None:
    sp = SamplingParams(stop_token_ids=(5, 3, 5, 1), bad_words=["x", "y", "x"])
    assert sp.stop_token_ids == [5, 3, 1]
    assert sp.bad_words == ["x", "y"]


def test_bad_words_single_string_becomes_list() -> None:
    assert SamplingParams(bad_words="damn").bad_words == ["damn"]


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_is_zero(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).top_k == 0


def test_top_k_positive_kept() -> None:
    assert SamplingParams(top_k=50).top_k == 50


def test_greedy_normalisation() -> None:
    sp = SamplingParams(temperature=0, top_p=0.5, top_k=10, min_p=0.2)
    assert sp.temperature == 0.0 and isinstance(sp.temperature, float)
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    assert sp.is_greedy and sp.sampling_type is SamplingType.GREEDY


def test_tiny_temperature_is_clamped_not_greedy() -> None:
    sp = SamplingParams(temperature=1e-4)
    assert sp.temperature == pytest.approx(0.01)
    assert not sp.is_greedy


def test_seeded_sampling_type() -> None:
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=-1).seed is None


def test_max_tokens_none_allowed() -> None:
    sp = SamplingParams(max_tokens=None, min_tokens=100)
    assert sp.max_tokens is None and sp.min_tokens == 100


@pytest.mark.parametrize(("value", "expected"), [(None, None), (0, 0), (5, 5), (-1, -1), (True, 1), (False, None)])
def test_logprobs_values(value: Any, expected: int | None) -> None:
    sp = SamplingParams(logprobs=value, prompt_logprobs=value)
    assert sp.logprobs == expected and sp.prompt_logprobs == expected


def test_logit_bias_keys_normalised_to_int() -> None:
    sp = SamplingParams(logit_bias={"12": 5, 7: -1.5, " 3 ": float("-inf")})
    assert sp.logit_bias == {12: 5.0, 7: -1.5, 3: float("-inf")}
    assert all(type(k) is int and type(v) is float for k, v in sp.logit_bias.items())


def test_allowed_token_ids_and_truncation() -> None:
    sp = SamplingParams(allowed_token_ids=(4, 5), truncate_prompt_tokens=-1)
    assert sp.allowed_token_ids == [4, 5] and sp.truncate_prompt_tokens == -1
    assert SamplingParams(truncate_prompt_tokens=128).truncate_prompt_tokens == 128


def test_numpy_like_integers_accepted() -> None:
    class IntLike:
        def __index__(self) -> int:
            return 7

    assert SamplingParams(max_tokens=IntLike()).max_tokens == 7  # type: ignore[arg-type]


def test_bool_fields_accept_zero_one() -> None:
    assert SamplingParams(ignore_eos=1).ignore_eos is True


def test_int_penalties_become_floats() -> None:
    sp = SamplingParams(presence_penalty=1, frequency_penalty=-1, repetition_penalty=2, top_p=1)
    assert [type(v) for v in (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.top_p)] == [
        float
    ] * 4


def test_compatibility_fields_accepted() -> None:
    sp = SamplingParams(
        output_kind=RequestOutputKind.FINAL_ONLY,
        flat_logprobs=True,
        extra_args={"k": 1},
        logits_processors=[],
        stream_interval=4,
        n=3,
        best_of=3,
    )
    assert sp.output_kind is RequestOutputKind.FINAL_ONLY
    assert sp.extra_args == {"k": 1} and sp.logits_processors is None and sp.best_of == 3


def test_trl_style_construction() -> None:
    """TRL 1.x builds greedy-free params with logprobs=0 and an explicit top_k=-1."""
    sp = SamplingParams(
        n=1,
        repetition_penalty=1.0,
        temperature=0.9,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        max_tokens=256,
        logprobs=0,
        guided_decoding=None,
        structured_outputs=None,
    )
    assert sp.top_k == 0 and sp.logprobs == 0


# ------------------------------------------------------------ engine hooks


def test_update_from_tokenizer_bad_words() -> None:
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [100 + ord(c) if i == 0 and c == " " else ord(c) for i, c in enumerate(text)][:2]

    sp = SamplingParams(bad_words=["ab"])
    sp.update_from_tokenizer(Tok())
    assert sp.bad_words_token_ids == [[97, 98], [132, 97]]


# ----------------------------------------------------------------- clone/repr


def test_clone_is_independent() -> None:
    sp = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0}, extra_args={"a": [1]})
    other = sp.clone()
    assert other == sp and other is not sp
    other.stop.append("y")
    other.stop_token_ids.append(2)
    other.logit_bias[2] = 2.0
    other.extra_args["a"].append(2)
    assert sp.stop == ["x"] and sp.stop_token_ids == [1] and sp.logit_bias == {1: 1.0}
    assert sp.extra_args == {"a": [1]}


def test_repr_lists_fields() -> None:
    text = repr(SamplingParams(temperature=0.5, stop="x"))
    assert text.startswith("SamplingParams(")
    assert "temperature=0.5" in text and "stop=['x']" in text and "max_tokens=16" in text


def test_equality() -> None:
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(top_k=3) != SamplingParams(top_k=4)


# -------------------------------------------------------------------- outputs


def test_logprob_defaults() -> None:
    lp = Logprob(-0.5)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.5, None, None)
    assert Logprob(logprob=-1.0, rank=2, decoded_token="a").rank == 2


def test_completion_output_fields_and_finished() -> None:
    names = [f.name for f in dataclasses.fields(CompletionOutput)]
    assert names == [
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "lora_request",
    ]
    running = CompletionOutput(0, "hi", [1, 2], None, None)
    assert not running.finished()
    done = CompletionOutput(0, "hi", [1, 2], -1.2, [{1: Logprob(-0.2, 1, "h")}, {2: Logprob(-1.0, 1, "i")}], "stop", 2)
    assert done.finished() and done.stop_reason == 2
    assert "text='hi'" in repr(done)


def test_request_output_fields() -> None:
    completion = CompletionOutput(0, "x", [3], None, None, "length")
    out = RequestOutput("0", "p", [1, 2], [None, {2: Logprob(-0.1)}], [completion], True)
    assert out.outputs[0].text == "x" and out.finished
    assert out.prompt_logprobs[0] is None
    assert out.lora_request is None and out.metrics is None and out.num_cached_tokens is None
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert names[:6] == ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"]
    kw = RequestOutput(
        request_id="1",
        prompt=None,
        prompt_token_ids=[1],
        prompt_logprobs=None,
        outputs=[],
        finished=False,
        lora_request=None,
        num_cached_tokens=0,
    )
    assert kw.num_cached_tokens == 0
    assert "request_id='1'" in repr(kw)
    out.extra = 1  # clients may attach attributes


# ----------------------------------------------------------------------- LoRA


def test_lora_request_from_path() -> None:
    req = LoRARequest("adapter", 1, "/tmp/adapter")
    assert (req.adapter_id, req.name, req.path) == (1, "adapter", "/tmp/adapter")
    with pytest.warns(DeprecationWarning):
        assert req.local_path == "/tmp/adapter"


def test_lora_request_unsloth_tensors() -> None:
    req = LoRARequest(str(3), 3, lora_tensors={"a.lora_A.weight": object()}, lora_config={"r": 8, "lora_alpha": 16})
    assert req.lora_path == "" and req.lora_config["r"] == 8
    assert "<1 tensors>" in repr(req)


def test_lora_local_path_alias() -> None:
    with pytest.warns(DeprecationWarning):
        req = LoRARequest("a", 1, lora_local_path="/x")
    assert req.lora_path == "/x"


def test_lora_equality_by_name() -> None:
    a = LoRARequest("same", 1, "/a")
    b = LoRARequest("same", 2, "/b")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != LoRARequest("other", 1, "/a")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"lora_int_id": 0}, ValueError, "lora_int_id"),
        ({"lora_int_id": -1}, ValueError, "lora_int_id"),
        ({"lora_int_id": "1"}, TypeError, "lora_int_id"),
        ({"lora_int_id": True}, TypeError, "lora_int_id"),
        ({"lora_name": 5}, TypeError, "lora_name"),
        ({"lora_path": ""}, ValueError, "lora_path"),
        ({"lora_path": "", "lora_tensors": {"w": 1}}, ValueError, "lora_config"),
        ({"lora_path": "", "lora_tensors": [1], "lora_config": {}}, TypeError, "lora_tensors"),
        ({"long_lora_max_len": 4096}, NotImplementedError, "long_lora_max_len"),
    ],
)
def test_lora_request_invalid(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    base: dict[str, Any] = {"lora_name": "x", "lora_int_id": 1, "lora_path": "/p"}
    with pytest.raises(error, match=name), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        LoRARequest(**{**base, **kwargs})
