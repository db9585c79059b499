"""Structured outputs' token bitmask applied to the logits in one kernel, in place, on the device (no host round
trip per row): the semantics of deepinfer_core.sampling.bitmask.apply_token_bitmask (a token not allowed by its
row's int32 words gets -inf; every other logit keeps its bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.sampling.bitmask import apply_token_bitmask as reference
from deepinfer_core.sampling.bitmask import check_bitmask
from deepinfer_nvidia_sm100.kernels._common import INTERPRET


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, W, s_row, sm_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tokens // 32
    inside = (tokens < V) & (words < W)
    word = tl.load(mask_ptr + row * sm_row + words, mask=inside, other=0)
    allowed = ((word >> (tokens % 32)) & 1) == 1
    ptrs = logits_ptr + row * s_row + tokens
    tl.store(ptrs, tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=(tokens < V) & ~(allowed & inside))  # fmt: skip


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where bitmask [B, W] int32 disallows the token: written into `logits` itself (a
    contiguous-rows tensor on the GPU, or any tensor under Triton's interpreter; others: the definition)."""
    check_bitmask(logits, bitmask)
    if not (logits.is_cuda or INTERPRET) or logits.stride(1) != 1:
        return reference(logits, bitmask)
    return launch(logits, bitmask.contiguous())


def launch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The kernel over logits [B, V] (unit stride along V) and a contiguous int32 mask [B, W], in place."""
    rows, vocab = logits.shape
    if rows and vocab:
        block = 1024
        _bitmask_kernel[(rows, triton.cdiv(vocab, block))](
            logits, bitmask, vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0), BLOCK=block
        )
    return logits
