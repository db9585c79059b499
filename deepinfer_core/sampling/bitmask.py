"""Token bitmasks: the tokens a constrained request (structured outputs, issue #19) may emit at a position.

Layout (the one llguidance and xgrammar fill): int32 words [rows, ceil(V / 32)]; token t is allowed in a row when
bit t % 32 of word t // 32 is set (word -1: all 32 allowed). Tokens past the mask's last word are not allowed.

`apply_token_bitmask` is the definition: every token a row's mask does not allow gets -inf, every other logit is
left exactly as it was (an all-ones row is bitwise unchanged). A sampler may ship a faster `apply_token_bitmask`
of its own (Sampler's optional method; nvidia_sm100's is a Triton kernel); `masked_logits` calls the sampler's
where it has one, this definition otherwise. A row whose mask allows nothing comes out all -inf: the caller
(the grammar) must end such a request instead of sampling it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "allowed_tokens",
    "apply_token_bitmask",
    "bitmask_width",
    "check_bitmask",
    "masked_logits",
    "token_bitmask",
]


def bitmask_width(vocab_size: int) -> int:
    """int32 words a row of the mask has for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: byte value -> its bits, low first


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [B, W] int32 -> bool [B, vocab_size]: which tokens each row allows (none past word W - 1)."""
    rows, words = bitmask.shape
    # little-endian words as bytes: byte k of a row holds tokens 8k .. 8k + 7, lowest bit first (a table lookup)
    data = bitmask.contiguous().view(torch.uint8).long()  # [B, 4W]
    bits = _BYTE_BITS.to(bitmask.device)[data].view(rows, words * 32)
    if vocab_size <= words * 32:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(rows, vocab_size - words * 32)], dim=1)


def check_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """ValueError unless `bitmask` is int32 [rows, words] with one row per row of `logits`."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"a token bitmask is int32 [rows, words] with one row per logits row ({logits.shape[0]}); got "
            f"{str(bitmask.dtype).removeprefix('torch.')} {tuple(bitmask.shape)}"
        )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf wherever the row's mask bitmask [B, W] (int32) disallows the token (a new tensor)."""
    check_bitmask(logits, bitmask)
    allowed = allowed_tokens(bitmask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))


def masked_logits(sampler, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The sampler's apply_token_bitmask where it has one (it may write into `logits`), else the definition."""
    apply = getattr(sampler, "apply_token_bitmask", None)
    return apply(logits, bitmask) if apply is not None else apply_token_bitmask(logits, bitmask)


def token_bitmask(allowed: Sequence[Iterable[int] | None], vocab_size: int) -> torch.Tensor:
    """The mask [len(allowed), W] allowing, per row, the token ids listed (None: every token)."""
    words = bitmask_width(vocab_size)
    mask = torch.zeros(len(allowed), words * 32, dtype=torch.bool)
    for row, tokens in enumerate(allowed):
        if tokens is None:
            mask[row, :vocab_size] = True
        else:
            mask[row, list(tokens)] = True
    bits = mask.view(len(allowed), words, 32).to(torch.int64) << torch.arange(32)
    return _pack(bits.sum(dim=2))


def _pack(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit word values (int64) -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
