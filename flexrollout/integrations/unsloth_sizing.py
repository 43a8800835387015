"""The batch sizing of Unsloth's `fast_inference` engine, independent of Unsloth itself.

Unsloth builds its engine before it knows the GRPO run, so the engine is a placeholder until
first use (`LazyEngine`). Its batch dimension is max(the user's `max_batch_size`, 32, and
per_device_train_batch_size x steps_per_generation x num_generations once a GRPO trainer is
built). Growing is logged as a warning. An engine that was built but has not generated yet
(its CUDA graphs are not captured) is simply rebuilt at the new size: it shares the model's
weights, so that costs no copy. Growing an engine that has generated would need new graphs and
a new cache behind references clients already hold, so it raises a RuntimeError naming what to
pass to `from_pretrained` instead.
"""
from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 32


def grpo_batch_size(per_device_train_batch_size: int, steps_per_generation: int | None,
                    num_generations: int) -> int:
    """Sequences one GRPO generation round submits at once (the flex branch's rule)."""
    return per_device_train_batch_size * (steps_per_generation or 1) * num_generations


def required_batch_size(user_max_batch_size: int | None = None, grpo_need: int | None = None) -> int:
    """max(user floor, default 32, the GRPO run's need)."""
    sizes = [DEFAULT_MAX_BATCH_SIZE, user_max_batch_size or 0, grpo_need or 0]
    return max(sizes)


class LazyEngine:
    """`model.vllm_engine` before first use: records the batch size, builds on first access."""

    def __init__(self, build: Callable[[int], object], max_batch_size: int | None = None) -> None:
        self._build = build
        self.max_batch_size = required_batch_size(max_batch_size)
        self._engine = None
        self._used = False

    @property
    def built(self) -> bool:
        return self._engine is not None

    @property
    def used(self) -> bool:
        """Whether the engine has generated (and so may hold captured graphs and a cache)."""
        return self._used

    def ensure_batch_size(self, needed: int) -> None:
        """Grow to `needed` sequences, or refuse once the engine has generated."""
        if needed <= self.max_batch_size:
            return
        if self._used:
            raise RuntimeError(
                f"the flexrollout engine was already built for {self.max_batch_size} sequences and "
                f"has generated (its CUDA graphs are captured); this run needs {needed}. "
                f"Pass max_batch_size={needed} to from_pretrained")
        logger.warning("flexrollout engine batch size %d -> %d%s", self.max_batch_size, needed,
                       " (rebuilding the engine, which has not generated yet)" if self.built else "")
        self.max_batch_size = needed
        self._engine = None

    def engine(self):
        if self._engine is None:
            self._engine = self._build(self.max_batch_size)
        return self._engine

    def generate(self, *args, **kwargs):
        engine = self.engine()
        self._used = True
        return engine.generate(*args, **kwargs)

    def chat(self, *args, **kwargs):
        engine = self.engine()
        self._used = True
        return engine.chat(*args, **kwargs)

    def __deepcopy__(self, memo):
        # A copied model (a reference model, say) shares the engine rather than copying it and
        # the weights it holds.
        return self

    def __getattr__(self, name: str):
        # Only reached for attributes LazyEngine itself lacks: build, then delegate.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.engine(), name)
