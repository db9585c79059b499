"""Tiny DeepSeek-V4.1 checkpoints with random weights, written in the reference's layout (config.json, one
safetensors file, the fixtures' tokenizer for the engram hashes), for tests that vary the schedule freely.

With head_dim and index_head_dim not multiples of 16 the FP8/FP4 rounding of the caches does not apply (the
reference skips it then too), so two runs that add up floats in a different order cannot land on opposite
sides of a rounding step: engine tests can then ask for identical outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from deepinfer_conformance.tiny_v41 import SCHEDULE, TINY_V41, with_engram_sizes
from deepinfer_core.model.config_v41 import DeepseekV41Config
from deepinfer_core.model.demo import demo_weights_v41

TOKENIZER_FROM = Path(__file__).parents[1] / "fixtures" / "deepseek_v41" / "engram_top1"
VOCAB = 338  # the fixtures' tokenizer

# the conformance suite's tiny V4.1 without its layer schedule (SCHEDULES give one), narrower
BASE = {k: v for k, v in TINY_V41.items() if k not in SCHEDULE} | {
    "vocab_size": VOCAB,
    "hidden_size": 40,
    "moe_intermediate_size": 16,
    "engram_head_dim": 16,
}

# schedules that together cover every layer role (see docs/deepseek_v41_reference.md §8)
SCHEDULES = {
    "groups_and_candidates": {k: TINY_V41[k] for k in SCHEDULE},  # 6 layers: ratios 0, 2, 2, 1, 1, 1
    "ratio_four_then_decoder": {
        "num_hidden_layers": 5,
        "compress_ratios": [0, 4, 4, 1, 1],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3],
        "candidate_source_layer_id": -1,
        "engram_layer_ids": [2],
        "hc_mult": 2,
        "sliding_window": 5,
        "num_experts_per_tok": 1,
    },
}


def checkpoint_config(overrides: dict) -> dict:
    """The config.json of BASE | overrides, with the engram table sizes its layers imply."""
    return with_engram_sizes({**BASE, **overrides}, TOKENIZER_FROM / "tokenizer.json")


def copy_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_FROM / name, folder / name)
    return folder


def write_checkpoint(folder: Path, overrides: dict, seed: int = 0) -> Path:
    """A checkpoint in `folder` for BASE | overrides, random weights from `seed`."""
    raw = checkpoint_config(overrides)
    weights = demo_weights_v41(DeepseekV41Config.from_hf(raw), seed)
    copy_tokenizer(folder)
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    return folder
