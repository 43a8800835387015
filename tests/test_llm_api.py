"""LLM's construction from a model name: the hub options reach transformers' loaders.

Tiny random Llama with the word-level tokenizer of conftest (token i is the word "t{i}").
"""
from __future__ import annotations

import pytest
import transformers

from flexrollout import LLM, SamplingParams


@pytest.fixture
def from_pretrained_calls(monkeypatch, tiny_llama):
    """Model and tokenizer loads by name answered with the tiny Llama; each call's (name, kwargs)."""
    model, tok = tiny_llama()
    calls = {"model": [], "tokenizer": []}

    def fake(kind, result):
        def load(name, *args, **kwargs):
            calls[kind].append((name, kwargs))
            return result
        return load

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model", model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer", tok))
    return calls


def test_trust_remote_code_and_revision_reach_from_pretrained(from_pretrained_calls):
    LLM("org/remote-model", trust_remote_code=True, revision="abc123", dtype="float32",
        max_model_len=64, num_kv_pages=8)
    [(name, kwargs)] = from_pretrained_calls["model"]
    assert name == "org/remote-model"
    assert kwargs["trust_remote_code"] is True and kwargs["revision"] == "abc123"
    [(name, kwargs)] = from_pretrained_calls["tokenizer"]
    assert name == "org/remote-model"
    assert kwargs["trust_remote_code"] is True and kwargs["revision"] == "abc123"


def test_tokenizer_by_name_gets_them_too(from_pretrained_calls, tiny_llama):
    """An in-memory model with its tokenizer named: the tokenizer load gets the hub options."""
    model, _ = tiny_llama()
    LLM(model, tokenizer="org/tokenizer", trust_remote_code=True, revision="v2", max_model_len=64,
        num_kv_pages=8)
    assert from_pretrained_calls["model"] == []
    assert from_pretrained_calls["tokenizer"] == [("org/tokenizer", {"trust_remote_code": True,
                                                                     "revision": "v2"})]


def test_defaults_reach_from_pretrained(from_pretrained_calls):
    LLM("org/model", dtype="float32", max_model_len=64, num_kv_pages=8)
    [(_, kwargs)] = from_pretrained_calls["model"]
    assert kwargs["trust_remote_code"] is False and kwargs["revision"] is None
