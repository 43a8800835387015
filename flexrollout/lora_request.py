"""``LoRARequest`` with vLLM's fields plus Unsloth's in-memory extension.

vLLM loads an adapter from ``lora_path``.  Unsloth's ``model.load_lora(...,
load_tensors=True)`` instead builds
``LoRARequest(name, id, lora_tensors=state_dict, lora_config=peft_config)``
(a patch it applies to vLLM), handing over the LoRA A/B tensors and the PEFT
config directly; both forms are accepted here.

Like vLLM, two requests are equal (and hash equal) when their ``lora_name``
matches: the engine may key its adapter cache on the request itself.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"The '{old}' attribute is deprecated and will be removed in a future version. Please use '{new}' instead.",
        DeprecationWarning,
        stacklevel=3,
    )


@dataclass(eq=False)
class LoRARequest:
    """A LoRA adapter to apply to one generate call.

    ``lora_int_id`` must be a positive int and should be unique per adapter
    contents (Unsloth issues a fresh id on every ``load_lora`` call).  Either
    ``lora_path`` (a PEFT adapter directory) or ``lora_tensors`` (a
    ``{name: tensor}`` dict of LoRA A/B weights, with ``lora_config`` being the
    PEFT config as a dict or ``LoraConfig``) must be given.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None
    long_lora_max_len: int | None = None
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    lora_tensors: dict[str, Any] | None = None
    lora_config: dict[str, Any] | Any | None = None

    def __post_init__(self) -> None:
        self._check_identity()
        self._resolve_path()
        self._check_source()

    def _check_identity(self) -> None:
        if not isinstance(self.lora_name, str):
            raise TypeError(f"lora_name must be a str, got {type(self.lora_name).__name__}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    def _resolve_path(self) -> None:
        """Accept path-like objects and the deprecated ``lora_local_path`` alias."""
        self.lora_path = os.fspath(self.lora_path) if self.lora_path is not None else ""
        if self.lora_local_path:
            _deprecated("lora_local_path", "lora_path")
            if not self.lora_path:
                self.lora_path = os.fspath(self.lora_local_path)

    def _check_source(self) -> None:
        if self.long_lora_max_len is not None:
            raise NotImplementedError("long_lora_max_len is not supported by flexrollout (long LoRA was removed in vLLM)")
        if self.tensorizer_config_dict is not None:
            raise NotImplementedError("tensorizer_config_dict is not supported by flexrollout")
        if self.lora_tensors is not None:
            if not isinstance(self.lora_tensors, Mapping):
                raise TypeError(f"lora_tensors must be a dict of tensors, got {type(self.lora_tensors).__name__}")
            if self.lora_config is None:
                raise ValueError("lora_config is required with lora_tensors (rank, alpha and targets come from it)")
        elif not self.lora_path:
            raise ValueError("lora_path cannot be empty unless lora_tensors is given")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        _deprecated("local_path", "path")
        return self.lora_path

    @local_path.setter
    def local_path(self, value: str) -> None:
        _deprecated("local_path", "path")
        self.lora_path = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        tensors = "None" if self.lora_tensors is None else f"<{len(self.lora_tensors)} tensors>"
        return (
            f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, "
            f"lora_path={self.lora_path!r}, base_model_name={self.base_model_name!r}, "
            f"lora_tensors={tensors}, lora_config={self.lora_config!r})"
        )
