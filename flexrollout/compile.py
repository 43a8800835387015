"""torch.compile for the engine's functions, with dynamo's recompile limits raised only for them.

Decode compiles one static-shape specialisation per graph bucket (flex picks its fused decode
kernel only for a static batch), and a layer function serves every layer type and bucket: more
than dynamo's default of 8 specialisations per function. The raised limits are scoped to these
calls (`torch._dynamo.config.patch`), so the user's own compiled code keeps its settings.
"""
from __future__ import annotations

import functools

import torch

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
