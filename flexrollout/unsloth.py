"""`import flexrollout.unsloth` (before or after `import unsloth`) makes Unsloth's
`fast_inference=True` run on flexrollout, whatever UNSLOTH_FAST_INFERENCE says.

Setting UNSLOTH_FAST_INFERENCE=1 in the environment before Python starts does the same with no
import (the installed `flexrollout-unsloth.pth` hook). See docs/unsloth.md.
"""
from _flexrollout_unsloth import activate

from .integrations.unsloth import (LiveLoRARequest, UnslothEngine, attach_engine, attach_lora,
                                   install, load_lora, save_lora)

activate()

__all__ = ["activate", "install", "attach_engine", "attach_lora", "load_lora", "save_lora",
           "UnslothEngine", "LiveLoRARequest"]
