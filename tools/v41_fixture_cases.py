"""The tiny DeepSeek-V4.1 configurations, prompts and tokenizer behind tests/fixtures/deepseek_v41.

Used by tools/v41_reference_fixtures.py. Together the cases cover every layer kind (ratio 0 sliding; ratio 4, 2 and
ratio 1 kv sources and their consumers), two kv sources, index sources that own keys, reindex sources with and
without the two-level candidate top-k, YaRN on the compress rope, engram on two layers (also past the last kv
source), hyper-connections with hc_mult 2, 3 and 4, MoE with gate_temp != 1, swiglu_limit and a random correction
bias, top-1 and top-3 routing, sqrtsoftplus and sigmoid scores. deep_decoder_tail has the long prompts (50 and 83
tokens) and five layers past its last kv source, so that CED prefill and window snapshots at block boundaries
matter. head_dim and index_head_dim are multiples of 32 so the FP8/FP4 rounding runs. Index heads are 6 to 8 so
that ReLU-zero index scores rarely tie; each seed was picked so the recording has no knife edge (see
tools/v41_fixture_monitors.py); deep_decoder_tail's also so that the reference's greedy rows agree with prefilling
each prompt and its greedy tokens, one-shot or in chunks of 8 or 3 (a check the script does not make).
"""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2
# Words merged into single tokens: case, leading-space, accent and whitespace variants that the engram's
# compressed vocabulary folds together. Characters left unmerged (e.g. "☕", "日") stay as UTF-8 byte tokens, which
# decode to U+FFFD on their own and are keyed by their raw form.
# fmt: off
MERGED_WORDS = (
    "the", " the", "The", " The", "THE", " THE", "cafe", " café", " Café", " CAFÉ",
    " naive", " naïve", "hello", " Hello", " HELLO", " world", " World",
    " über", " Über", " uber", "  ", "   ", "\n", "\n\n", ".", "!", ",", "é", "É", "ï",
)
# fmt: on
PROMPT_TEXT = (
    "The cafe is open. THE CAFÉ is open!  The café and the Café, naïve or naive? "
    "Hello world, HELLO World; hello  world.\n\nÜber uber über, año ano Año... "
    "the THE The the. Ça va? 3.14 + 2 = 5?! ☕ 日本 and AND And is Is open Open.\n"
)


@dataclass(frozen=True)
class Case:
    name: str
    covers: tuple[str, ...]
    seed: int
    config: dict  # DeepseekV41TextConfig kwargs; vocab_size and engram sizes are filled in from the tokenizer
    prompt_lengths: tuple[int, ...]  # ragged prefill, one sequence at a time
    prompt_offsets: tuple[int, ...]  # where each prompt starts in the tokenized PROMPT_TEXT stream
    chunked_prompt: int  # index of the prompt that is also fed in chunks
    chunk_sizes: tuple[int, ...]
    decode_offset: int
    decode_prefill: int
    decode_steps: int
    greedy_tokens: int = 16


_COMMON = dict(
    num_key_value_heads=1,
    qk_rope_head_dim=16,
    initializer_range=0.1,
    rms_norm_eps=1e-20,
    num_nextn_predict_layers=0,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    hidden_act="silu",
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

CASES = (
    Case(
        name="two_groups_candidates",
        covers=(
            "ratio 0 sliding (layer 0, main rope)",
            "ratio 2 kv source + index source owning keys (layer 1) and its consumer (layer 2)",
            "ratio 1 kv source + index source owning keys + candidate source (layer 3)",
            "reindex source inside the candidate blocks (layer 4) and a ratio 1 consumer of its top-k (layer 5)",
            "two kv sources; candidate_block_size 2, candidate_topk_blocks 2, index_topk 3",
            "YaRN compress rope (factor 4, original 32)",
            "hc_mult 3, MoE top-2 of 4, gate_temp 0.7, swiglu_limit 0.6",
        ),
        seed=1107,
        config=dict(
            _COMMON,
            hidden_size=48,
            num_hidden_layers=6,
            num_attention_heads=2,
            head_dim=32,
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=12,
            sliding_window=8,
            compress_ratios=[0, 2, 2, 1, 1, 1],
            kv_source_layer_ids=[1, 3],
            index_source_layer_ids=[1, 3, 4],
            candidate_source_layer_id=3,
            candidate_block_size=2,
            candidate_topk_blocks=2,
            index_n_heads=8,
            index_head_dim=32,
            index_topk=3,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            max_position_embeddings=128,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            gate_temp=0.7,
            swiglu_limit=0.6,
            hc_mult=3,
            hc_sinkhorn_iters=3,
        ),
        prompt_lengths=(3, 9, 17, 30),
        prompt_offsets=(0, 13, 41, 5),
        chunked_prompt=3,
        chunk_sizes=(7, 1, 4, 11, 7),
        decode_offset=60,
        decode_prefill=19,
        decode_steps=9,
    ),
    Case(
        name="engram_top1",
        covers=(
            "ratio 0 sliding (layers 0 and 2)",
            "ratio 2 kv source + index source owning keys (layer 1); layer 3 reuses its group across a sliding layer",
            "engram on layers 0 and 2 (max n-gram 3, 2 heads, head_dim 32, engram_vocab_size 11)",
            "MoE top-1 (no weight normalisation) of 5, gate_temp 1.6, swiglu_limit 1.0",
            "hc_mult 2, no YaRN (default compress rope), index_topk 2",
        ),
        seed=2202,
        config=dict(
            _COMMON,
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=2,
            head_dim=64,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=24,
            sliding_window=6,
            compress_ratios=[0, 2, 0, 2],
            kv_source_layer_ids=[1],
            index_source_layer_ids=[1],
            candidate_source_layer_id=-1,
            index_n_heads=6,
            index_head_dim=32,
            index_topk=2,
            rope_theta=10000.0,
            compress_rope_theta=40000.0,
            max_position_embeddings=256,
            moe_intermediate_size=16,
            n_routed_experts=5,
            num_experts_per_tok=1,
            gate_temp=1.6,
            swiglu_limit=1.0,
            hc_mult=2,
            hc_sinkhorn_iters=4,
            engram_layer_ids=[0, 2],
            engram_vocab_size=11,
            engram_max_ngram_size=3,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_pad_id=0,
        ),
        prompt_lengths=(4, 7, 15, 26),
        prompt_offsets=(3, 30, 17, 50),
        chunked_prompt=3,
        chunk_sizes=(5, 2, 9, 3, 7),
        decode_offset=11,
        decode_prefill=11,
        decode_steps=10,
    ),
    Case(
        name="decoder_first_reindex",
        covers=(
            "ratio 1 kv source + index source owning keys at layer 0; reindex source without candidates (layer 1)",
            "ratio 0 sliding between groups (layer 2)",
            "ratio 2 kv source + index source owning keys (layer 3) and its consumer (layer 4); two kv sources",
            "engram on layers 1 and 4 (max n-gram 4, 2 heads, engram_vocab_size 5, pad = a normal token)",
            "YaRN compress rope (factor 2, original 16), hc_mult 4, MoE top-2 of 3, gate_temp 0.5, swiglu_limit 0.4",
        ),
        seed=3307,
        config=dict(
            _COMMON,
            hidden_size=32,
            num_hidden_layers=5,
            num_attention_heads=2,
            head_dim=32,
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=12,
            sliding_window=5,
            compress_ratios=[1, 1, 0, 2, 2],
            kv_source_layer_ids=[0, 3],
            index_source_layer_ids=[0, 1, 3],
            candidate_source_layer_id=-1,
            index_n_heads=8,
            index_head_dim=32,
            index_topk=2,
            rope_theta=5000.0,
            compress_rope_theta=20000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            max_position_embeddings=64,
            moe_intermediate_size=12,
            n_routed_experts=3,
            num_experts_per_tok=2,
            gate_temp=0.5,
            swiglu_limit=0.4,
            hc_mult=4,
            hc_sinkhorn_iters=2,
            engram_layer_ids=[1, 4],
            engram_vocab_size=5,
            engram_max_ngram_size=4,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_pad_id=40,
        ),
        prompt_lengths=(2, 6, 13, 24),
        prompt_offsets=(8, 22, 35, 1),
        chunked_prompt=3,
        chunk_sizes=(1, 6, 2, 10, 5),
        decode_offset=44,
        decode_prefill=9,
        decode_steps=8,
    ),
    Case(
        name="deep_decoder_tail",
        covers=(
            "ratio 0 sliding (layer 0); ratio 4 kv source + index source owning keys (layer 1) and its consumer (2)",
            "ratio 1 kv source + index source owning keys + candidate source (layer 3), the last kv source",
            "five CED decoder layers after it (4-8): reindex sources inside the candidate blocks (5 and 7), the "
            "layers between reuse their top-k; sliding_window 4, so CED prefill skips most prompt rows there",
            "candidate_block_size 4, candidate_topk_blocks 3, index_topk 5; 3 heads in 3 output groups",
            "engram on layers 2 and 6 (after the last kv source): max n-gram 2, 3 heads, engram_vocab_size 7, "
            "pad = <bos>",
            "YaRN compress rope (factor 8, original 32, beta_fast 16, beta_slow 2), hc_mult 3 with engram",
            "MoE top-3 of 6, sigmoid scoring, routed_scaling_factor 2.5, gate_temp 1.3, swiglu_limit 0.8",
            "prompts of 50 and 83 tokens, each ending 2-3 tokens past a block boundary (a prefix hit of 80 tokens), "
            "chunks 5+47+1+13+17, decode after 53 tokens",
        ),
        seed=4413,
        config=dict(
            _COMMON,
            hidden_size=32,
            num_hidden_layers=9,
            num_attention_heads=3,
            head_dim=32,
            q_lora_rank=16,
            o_groups=3,
            o_lora_rank=10,
            sliding_window=4,
            compress_ratios=[0, 4, 4, 1, 1, 1, 1, 1, 1],
            kv_source_layer_ids=[1, 3],
            index_source_layer_ids=[1, 3, 5, 7],
            candidate_source_layer_id=3,
            candidate_block_size=4,
            candidate_topk_blocks=3,
            index_n_heads=8,
            index_head_dim=32,
            index_topk=5,
            rope_theta=20000.0,
            compress_rope_theta=80000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
            },
            max_position_embeddings=256,
            moe_intermediate_size=8,
            n_routed_experts=6,
            num_experts_per_tok=3,
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            gate_temp=1.3,
            swiglu_limit=0.8,
            hc_mult=3,
            hc_sinkhorn_iters=5,
            engram_layer_ids=[2, 6],
            engram_vocab_size=7,
            engram_max_ngram_size=2,
            engram_n_heads=3,
            engram_head_dim=32,
            engram_pad_id=2,
        ),
        prompt_lengths=(6, 21, 50, 83),
        prompt_offsets=(77, 140, 250, 400),
        chunked_prompt=3,
        chunk_sizes=(5, 47, 1, 13, 17),
        decode_offset=301,
        decode_prefill=53,
        decode_steps=11,
    ),
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel uses): byte b is written as this character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def build_tokenizer():
    """A byte-level BPE: the 3 special tokens, the 256 byte tokens, then one token per merge step of MERGED_WORDS
    (multi-byte characters first, then each word left to right). Built, not trained, so it is the same every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    merges = []

    def merge(left: str, right: str) -> str:
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
        return left + right

    for word in MERGED_WORDS:
        units = []
        for char in word:
            pieces = [alphabet[b] for b in char.encode("utf-8")]
            unit = pieces[0]
            for piece in pieces[1:]:
                unit = merge(unit, piece)
            units.append(unit)
        token = units[0]
        for unit in units[1:]:
            token = merge(token, unit)

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
