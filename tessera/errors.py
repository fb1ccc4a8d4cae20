"""User-facing errors: each carries one line saying what is wrong and what to do.

The CLI prints `str(error)` without a traceback and exits non-zero; the server
maps them to OpenAI-style JSON errors.
"""
from __future__ import annotations


class TesseraError(Exception):
    """Base class for errors whose message is meant for the user as is."""

    exit_code = 1


class ModelNotFoundError(TesseraError):
    """Unknown registry name, missing path, or a hub id that cannot be fetched."""


class ModelFormatError(TesseraError):
    """A file that is truncated, corrupt, or uses an unsupported architecture or tensor type."""


class ChecksumError(TesseraError):
    """Downloaded or assembled bytes do not match the recorded sha256."""


class ConfigError(TesseraError, ValueError):
    """An engine option out of range (a ValueError too, for Python API callers)."""

    exit_code = 2


class AdapterError(TesseraError):
    """A LoRA adapter that cannot be served on its base model (format, shapes, rank, targets); the
    server answers 400."""
