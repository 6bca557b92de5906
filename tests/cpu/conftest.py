"""Fixtures of the loader engine tests (defined in loader_support)."""

from loader_support import auto_tokens, loader_env  # noqa: F401
