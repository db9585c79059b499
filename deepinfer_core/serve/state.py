"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import deepseek_recipe as dr

from deepinfer_core.engine.tokenizer import Tokenizer
from deepinfer_core.serve.async_engine import AsyncEngine
from deepinfer_core.serve.metrics import ServerMetrics

__all__ = ["ServerState", "build_recipe", "droppable_special_ids"]

# deepseek-recipe's own `max_tokens` ceiling would refuse (chat, responses) or silently lower (messages) an
# output limit that the context allows; the context is the limit we check, so its ceiling is lifted
_NO_RECIPE_CEILING = 2**31 - 1


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
    # output limit of a request that sets none; None: the rest of the context (vLLM's default). Either way
    # capped by the context and the KV cache, so a request without a limit is never refused for its size
    default_max_tokens: int | None = None
    # special tokens left out of chat/responses/messages text when a request skips special tokens
    # (the default): those the tokenizer marks special that the protocol parser does not need
    droppable_special_ids: frozenset[int] = field(init=False)
    # the most bytes of text one token stands for (None: no bound), for refusing before encoding a prompt
    # that cannot fit the context
    max_token_bytes: int | None = field(init=False)
    # the end-of-thinking token: a thinking-mode answer's constraint (structured outputs) holds after it
    thinking_end_id: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.droppable_special_ids = droppable_special_ids(self.tokenizer, self.recipe_tokenizer, self.options)
        self.max_token_bytes = self.tokenizer.max_token_bytes()
        end = self.tokenizer.encode(self.options.special_tokens.token(dr.SpecialToken.ThinkingEnd), False)
        self.thinking_end_id = end[0] if len(end) == 1 else None

    @property
    def kv_capacity_tokens(self) -> int:
        """The most KV one request can hold: the whole cache, or one rank's where several serve (a request runs
        on one; parallel/rank_reports.RanksBlocks)."""
        blocks = self.engine.engine.blocks
        return getattr(blocks, "per_rank_tokens", blocks.num_blocks * blocks.block_size)


def droppable_special_ids(
    tokenizer: Tokenizer, recipe_tokenizer: dr.Tokenizer, options: dr.ConversionOptions
) -> frozenset[int]:
    """Ids of the tokenizer's special tokens, less the recipe's structural ones (thinking, tool calls, end
    of sequence, ...: its parser reads them) and less what the engine's EOS handling covers."""
    spellings = options.special_tokens
    structural = set()
    for name in dir(dr.SpecialToken):
        kind = getattr(dr.SpecialToken, name)
        if isinstance(kind, dr.SpecialToken):
            ids = recipe_tokenizer.encode(spellings.token(kind))
            if len(ids) == 1:
                structural.add(ids[0])
    added = tokenizer._tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
    return frozenset(i for i, token in added.items() if token.special and i not in structural)


def build_recipe(
    tokenizer_file: str, served_model_name: str
) -> tuple[dr.Tokenizer, dr.DeepseekV4Encoding, dr.ConversionOptions]:
    """deepseek-recipe's tokenizer, the DeepSeek-V4 prompt encoding, and conversion options that accept
    exactly the served model name (thinking mode off unless a request asks for it)."""
    recipe_tokenizer = dr.Tokenizer.from_file(tokenizer_file)
    encoding = dr.DeepseekV4Encoding().with_tokenizer(recipe_tokenizer)
    options = (
        dr.ConversionOptions(default_thinking_mode=False)
        .with_model_versions_by_name({served_model_name: dr.ModelVersion.DeepseekV4Pro})
        .with_thinking_max_tokens_upper_bound(_NO_RECIPE_CEILING)
        .with_non_thinking_max_tokens_upper_bound(_NO_RECIPE_CEILING)
    )
    return recipe_tokenizer, encoding, options
