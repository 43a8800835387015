"""The engine's kernels, each registered as a torch custom op that torch.compile traces.

Their namespace carries a hash of the sources that define them (`kernels/`, `layers/`).
Inductor's FX graph cache keys a compiled graph by its code, where a custom op appears by name
only: the op's fake implementation, which gives its output shape (a split-K kernel's number of
K slices), is not part of the key. A graph cached by an earlier flexrollout would then run
against a changed op and fail on its output's shape (seen on CPU when the 4-bit kernel's K
slices changed, 2026-12-07). With the hash in the name, a changed op is a new name, so the
graph misses the cache instead.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def sources_hash(package: Path) -> str:
    """A short hash of the package's `kernels/` and `layers/` sources, where the ops live."""
    digest = hashlib.sha256()
    for path in sorted([*package.glob("kernels/*.py"), *package.glob("layers/*.py")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


NAMESPACE = f"flexrollout_{sources_hash(Path(__file__).resolve().parent.parent)}"


def custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """`torch.library.custom_op` under flexrollout's namespace."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


def registered(name: str):
    """The op registered as `name` (`torch.ops.<namespace>.<name>`)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
