"""nvidia_sm100's token bitmask kernel under Triton's interpreter: the definition's result bit for bit, in place."""

from __future__ import annotations

import torch

from deepinfer_core.sampling.bitmask import apply_token_bitmask as reference
from deepinfer_core.sampling.bitmask import token_bitmask
from deepinfer_nvidia_sm100.kernels.bitmask import apply_token_bitmask


def test_the_kernel_masks_in_place_as_the_definition():
    g = torch.Generator().manual_seed(1)
    vocab = 2100  # three 1024-token blocks, a ragged last word
    logits = torch.randn(4, vocab, generator=g)
    subsets = [torch.nonzero(torch.rand(vocab, generator=g) < 0.3).flatten().tolist() for _ in range(2)]
    mask = token_bitmask([None, [2099], *subsets], vocab)
    mask[3, 40:] = 0  # a mask that ends early
    want = reference(logits, mask)
    got = apply_token_bitmask(logits, mask)
    assert got.data_ptr() == logits.data_ptr()  # in place
    assert torch.equal(got, want)


def test_bfloat16_logits_keep_their_bits():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    mask = token_bitmask([list(range(0, 100, 3)), None], 100)
    want = reference(logits, mask)
    assert torch.equal(apply_token_bitmask(logits.clone(), mask), want)
