"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import deepseek_recipe as dr

from deepinfer_core.engine.tokenizer import Tokenizer
from deepinfer_core.serve.async_engine import AsyncEngine
from deepinfer_core.serve.metrics import ServerMetrics

__all__ = ["ServerState", "build_recipe"]


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    tokenizer: Tokenizer  # ours: legacy completions
    recipe_tokenizer: dr.Tokenizer  # deepseek-recipe's: prompt encoding and output parsing
    encoding: dr.DeepseekV4Encoding
    options: dr.ConversionOptions
    max_model_len: int
    eos_token_ids: frozenset[int]
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 8 << 20


def build_recipe(
    tokenizer_file: str, served_model_name: str
) -> tuple[dr.Tokenizer, dr.DeepseekV4Encoding, dr.ConversionOptions]:
    """deepseek-recipe's tokenizer, the DeepSeek-V4 prompt encoding, and conversion options that accept
    exactly the served model name (thinking mode off unless a request asks for it)."""
    recipe_tokenizer = dr.Tokenizer.from_file(tokenizer_file)
    encoding = dr.DeepseekV4Encoding().with_tokenizer(recipe_tokenizer)
    options = dr.ConversionOptions(default_thinking_mode=False).with_model_versions_by_name(
        {served_model_name: dr.ModelVersion.DeepseekV4Pro}
    )
    return recipe_tokenizer, encoding, options
