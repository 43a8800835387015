"""torch.compile for the engine's functions, with dynamo's recompile limits raised only for them.

Decode compiles one static-shape specialisation per graph bucket (flex picks its fused decode
kernel only for a static batch), and a layer function serves every layer type and bucket: more
than dynamo's default of 8 specialisations per function. The raised limits are scoped to these
calls (`torch._dynamo.config.patch`), so the user's own compiled code keeps its settings.

`deepest_fitting` compiles a kernel (a Triton launch, flex's decode template) with fewer pipeline
stages where the depth asked does not fit the GPU's shared memory.
"""
from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

_LIMITS = dict(recompile_limit=64, accumulated_recompile_limit=512)


def compiled(fn, dynamo_config: dict | None = None, **options):
    """`fn` compiled with `options`, called under the engine's recompile limits and
    `dynamo_config` (dynamo settings scoped to this function's calls, which is when it traces)."""
    compiled_fn = torch.compile(fn, **options)
    settings = {**_LIMITS, **(dynamo_config or {})}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**settings):
            return compiled_fn(*args, **kwargs)

    return call


def separate_cache(fn, suffix: str):
    """`fn` under its own code object, named `<name>_<suffix>`. Dynamo keeps compiled entries
    per code object, and two torch.compile wrappers of one function with the same backend share
    them: a call takes whichever entry's guards pass, though it was compiled under the other
    wrapper's settings (a symbolic-shape entry passes every width). A separate code object
    keeps each wrapper's compiles its own."""
    name = f"{fn.__name__}_{suffix}"
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {})}
    code = fn.__code__.replace(**names)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def deepest_fitting(run: Callable[[int], T], asked: int, key, fitted: dict,
                    errors: type[BaseException] | tuple, too_big: Callable[[BaseException], bool]) -> T:
    """`run(depth)` with `asked` pipeline stages, or with the deepest that fits shared memory:
    one stage fewer each time it raises one of `errors` for which `too_big(err)` holds (a
    compiler's refusal, before anything runs). The depth that fit is kept in `fitted[key]`, so
    later calls of that variant start there; other errors, and a single stage too big, raise."""
    depth = fitted.get(key, asked)
    while True:
        try:
            result = run(depth)
            break
        except errors as err:
            if depth <= 1 or not too_big(err):
                raise
            depth -= 1
    if depth != asked and key not in fitted:
        logger.info("%s: %d pipeline stages fit shared memory, not %d", key, depth, asked)
    fitted[key] = depth
    return result
