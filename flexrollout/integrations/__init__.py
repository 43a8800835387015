"""Integrations with training libraries (each imports its library only when called)."""
from .trl import patch_trl

__all__ = ["patch_trl"]
