"""Where a DeepSeek-V4 checkpoint keeps each tensor the model needs: under our names (transformers' first
`deepseek_v4` spelling: `model.` prefix, `model.embed_tokens`, `model.hc_head.hc_fn`) or DeepSeek's native ones, as
the released V4 Flash has them (no prefix, `embed`, `hc_head_fn`, the attention's KV norm as `attn.kv_norm`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepinfer_core.model.loader import StoredTensor

__all__ = ["v4_native_name", "v4_spellings"]

_NATIVE = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^model\.embed_tokens\.weight$", "embed.weight"),
        (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
        (r"^model\.", ""),
    )
)


def v4_native_name(name: str) -> str:
    """Our name as DeepSeek's native V4 checkpoints spell it."""
    for pattern, replacement in _NATIVE:
        name = pattern.sub(replacement, name)
    return name


def v4_spellings(name: str) -> Sequence[StoredTensor]:
    """For the loader: ours first, then the native spelling (each tensor is looked up on its own)."""
    native = v4_native_name(name)
    return (StoredTensor(name), StoredTensor(native)) if native != name else (StoredTensor(name),)
