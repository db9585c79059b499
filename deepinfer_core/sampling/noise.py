"""Counter-based sampling noise: Gumbel(seed, step, token id), the same bits on every backend.

The noise for token t at generation step s of a request seeded with k depends on (k, s, t) only, so a
request's sampled tokens depend only on its own logits and seed: batch-invariant by construction.
Definition (all integer arithmetic modulo 2**32):
    h = mix(mix(mix(mix(seed_hi) ^ seed_lo) ^ step) ^ token)
    u = (h + 0.5) / 2**32                 exact in float64, in (0, 1)
    g = float32(-log(-log(u)))            computed in float64, rounded once
where mix is the "lowbias32" integer finalizer (xorshift-multiply, constants 0x7feb352d, 0x846ca68b).
"""

from __future__ import annotations

import torch

__all__ = ["gumbel_noise", "hash_counters", "row_hashes"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 holds the 32-bit value; products wrap in int64, and their low 32 bits are still exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_hashes(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The per-row part of the hash: mix(mix(mix(seed_hi) ^ seed_lo) ^ step) [B], int64 holding uint32.
    A token's hash is then mix(row_hash ^ token id) (what a noise kernel computes per element)."""
    seeds = seeds.to(torch.int64)
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    h = _mix32(_mix32(seed_hi) ^ seed_lo)
    return _mix32(h ^ (steps.to(torch.int64) & _MASK32))  # [B]


def hash_counters(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit hashes [B, V] (int64 holding uint32) of (seed [B], step [B], token id 0..V-1)."""
    h = row_hashes(seeds, steps)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    return _mix32(h[:, None] ^ tokens[None, :])  # [B, V]


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] float32 for requests with `seeds` [B] at generation `steps` [B]."""
    u = (hash_counters(seeds, steps, vocab_size).to(torch.float64) + 0.5) / 2.0**32
    return (-torch.log(-torch.log(u))).to(torch.float32)
