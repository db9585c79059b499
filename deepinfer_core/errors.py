"""Errors meant for people: the CLI prints their message (no traceback) and exits non-zero."""

from __future__ import annotations

__all__ = ["BackendContractError", "BackendSelectionError", "CheckpointError", "DeepInferError", "RequestError"]


class DeepInferError(Exception):
    """Base of every error whose message says what was wrong and what to do."""


class BackendSelectionError(DeepInferError):
    """The requested accelerator is unknown, broken or unavailable here."""


class BackendContractError(DeepInferError):
    """A backend answered a hook with something the contract does not allow."""


class RequestError(DeepInferError):
    """A request the engine cannot serve as asked (too long, bad ids, no tokenizer for text)."""


class CheckpointError(DeepInferError):
    """The checkpoint on disk is missing something or holds something of the wrong shape or format."""
