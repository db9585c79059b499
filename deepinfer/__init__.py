"""DeepInfer's public Python API, spelled as vLLM's: `from deepinfer import LLM, SamplingParams`.

Names load on first use, so `import deepinfer` stays quick (torch and the engine load with `LLM`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from deepinfer_core import __version__

if TYPE_CHECKING:
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.engine.prompts import PromptType, TextPrompt, TokensPrompt
    from deepinfer_core.engine.request import CompletionOutput, Logprob, RequestOutput
    from deepinfer_core.errors import DeepInferError
    from deepinfer_core.sampling.params import SamplingParams
    from deepinfer_core.structured.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "DeepInferError",
    "Logprob",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

_WHERE = {
    "LLM": "deepinfer_core.engine.llm",
    "CompletionOutput": "deepinfer_core.engine.request",
    "Logprob": "deepinfer_core.engine.request",
    "RequestOutput": "deepinfer_core.engine.request",
    "SamplingParams": "deepinfer_core.sampling.params",
    "StructuredOutputsParams": "deepinfer_core.structured.params",
    "DeepInferError": "deepinfer_core.errors",
    "PromptType": "deepinfer_core.engine.prompts",
    "TextPrompt": "deepinfer_core.engine.prompts",
    "TokensPrompt": "deepinfer_core.engine.prompts",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
