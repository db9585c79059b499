"""DeepSeek-V4.1 engram hashing inputs: the compressed vocabulary, the prime buckets and the hash multipliers.

All three must match the reference bit for bit: the released tables were trained against them, so a
different token map, prime or multiplier silently reads the wrong rows. Pure functions over numpy and the
`tokenizers` library; no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from deepinfer_core.model.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from deepinfer_core.model.config_v41 import DeepseekV41Config

__all__ = [
    "check_compressed_vocabulary",
    "compressed_vocabulary",
    "engram_offsets",
    "engram_primes",
    "hash_multipliers",
    "is_prime",
]

# Deterministic Miller-Rabin: these witnesses decide every n < 3.3e24 exactly.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_SENTINEL = "\ue000"  # private use: keeps a lone-space token from being stripped to ""


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """primes[k][n - 2][h]: the bucket count of head h of the n-gram of the k-th engram layer.

    Each order restarts its search just below `vocab_size`; each head takes the next prime not taken by
    any earlier (layer, order, head), so layer 0's 2-grams get the smallest primes >= vocab_size."""
    seen: set[int] = set()
    primes = []
    for _ in range(n_layers):
        layer = []
        for _ in range(max_ngram_size - 1):
            current, order = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                order.append(current)
            layer.append(order)
        primes.append(layer)
    return primes


def engram_offsets(layer_primes: list[list[int]]) -> list[int]:
    """Row offset of each (order, head) column of one layer's table: order-major, head-minor, from 0."""
    flat = [p for order in layer_primes for p in order]
    return [sum(flat[:i]) for i in range(len(flat))]


def hash_multipliers(layer_ids: list[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd multipliers [len(layer_ids), max_ngram_size] (int64), one row per engram layer id (the real
    layer index), bounded so that compressed id x multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer in layer_ids:
        rng = np.random.default_rng(10007 * layer)
        rows.append(rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1)
    return np.stack(rows) if rows else np.zeros((0, max_ngram_size), dtype=np.int64)


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_vocabulary(tokenizer: Tokenizer | str | Path) -> tuple[list[int], int]:
    """(token_map: token id -> compressed id, compressed size) for a `tokenizers.Tokenizer` or the path of
    its tokenizer.json.

    Tokens that decode to the same text after NFKC, accent stripping, lower-casing and whitespace
    collapsing share one id (" The", "the", "THE"); a lone whitespace token keeps the key " "; a token that
    decodes to a partial UTF-8 sequence ("\\ufffd") is keyed by its raw token string. Compressed ids are
    numbered in order of first appearance over every id, added tokens included."""
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    normalize = _normalizer().normalize_str
    key_to_id: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        token_map.append(key_to_id.setdefault(key, len(key_to_id)))
    return token_map, len(key_to_id)


def check_compressed_vocabulary(config: DeepseekV41Config, tokenizer: Tokenizer | str | Path) -> list[int]:
    """The token map for `config`'s engram layers; refuses a tokenizer whose compressed size differs from
    `engram_compressed_vocab_size` (the hash multipliers and tables were built for that size)."""
    token_map, size = compressed_vocabulary(tokenizer)
    if size != config.engram_compressed_vocab_size:
        raise ConfigError(
            f"the tokenizer's compressed engram vocabulary has {size} entries but config.json's "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}; the engram tables only "
            "match the tokenizer they were trained with: use the checkpoint's own tokenizer.json"
        )
    if not 0 <= config.engram_pad_id < len(token_map):
        raise ConfigError(
            f"engram_pad_id {config.engram_pad_id} is not a token id of the tokenizer (0..{len(token_map) - 1}); "
            "set it to the id of the padding token"
        )
    return token_map
