"""Unsloth fast_inference sizing rule and refuse-to-grow (no Unsloth needed)."""
from __future__ import annotations

import logging

import pytest

from flexrollout.integrations.unsloth_sizing import (LazyEngine, grpo_batch_size,
                                                     required_batch_size)


def test_sizing_rule():
    assert required_batch_size() == 32
    assert required_batch_size(user_max_batch_size=16) == 32
    assert required_batch_size(user_max_batch_size=100) == 100
    need = grpo_batch_size(per_device_train_batch_size=4, steps_per_generation=4, num_generations=8)
    assert need == 128
    assert required_batch_size(user_max_batch_size=64, grpo_need=need) == 128
    assert grpo_batch_size(2, None, 4) == 8


def test_lazy_engine_grows_before_build_and_refuses_after(caplog):
    built = []

    class Engine:
        def __init__(self, size):
            self.size = size
            self.approx_max_num_seqs = size

        def generate(self, prompt):
            return f"{prompt}@{self.size}"

    lazy = LazyEngine(lambda size: built.append(size) or Engine(size), max_batch_size=16)
    assert lazy.max_batch_size == 32 and not lazy.built and built == []
    with caplog.at_level(logging.WARNING):
        lazy.ensure_batch_size(64)
    assert "32 -> 64" in caplog.text
    lazy.ensure_batch_size(8)                       # smaller: nothing changes
    assert lazy.generate("hi") == "hi@64" and built == [64]
    assert lazy.approx_max_num_seqs == 64
    with pytest.raises(RuntimeError, match="max_batch_size=128"):
        lazy.ensure_batch_size(128)
    lazy.ensure_batch_size(64)                      # what it already has is fine
    assert built == [64]


def test_built_but_unused_engine_is_rebuilt_at_the_new_size(caplog):
    built = []

    class Engine:
        def __init__(self, size):
            self.size = size

        def generate(self, prompt):
            return f"{prompt}@{self.size}"

    lazy = LazyEngine(lambda size: built.append(size) or Engine(size))
    assert lazy.size == 32 and lazy.built and not lazy.used     # a read builds, but generates nothing
    with caplog.at_level(logging.WARNING):
        lazy.ensure_batch_size(96)
    assert "32 -> 96" in caplog.text and "rebuilding" in caplog.text and not lazy.built
    assert lazy.generate("hi") == "hi@96" and built == [32, 96] and lazy.used
    with pytest.raises(RuntimeError, match="max_batch_size=97"):
        lazy.ensure_batch_size(97)
