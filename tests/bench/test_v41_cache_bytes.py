"""bench/v41_cache_bytes.py against numbers derived by hand from the released schedules.

V4.1: 40 layers, ratios [0,0]+[2]*18+[1]*20; kv sources 2, 8, 14 (ratio 2) and 20 (ratio 1), each also an
index source, so each owns a 512-d compressed cache and a 128-d index-key cache; window 128 + 6 rollback
slots on every layer; engram look-back of 3 ids on layer 1 (4 kept: a decode step run again reads the same).
V4 Flash: 2 sliding, 21 CSA (rate 4, with indexer), 20 HCA (rate 128) layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import v41_cache_bytes  # noqa: E402

MIB = 1 << 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "v41_cache_bytes.json"
    v41_cache_bytes.main(["--out", str(out)])
    return json.loads(out.read_text())


def test_v41_per_token_caches_follow_the_sharing(report):
    bf16, packed = (report["models"]["v41"]["caches"][s] for s in ("bf16", "packed"))
    assert bf16["compressed"]["layers"] == bf16["index_keys"]["layers"] == [2, 8, 14, 20]
    assert bf16["compressed"]["bytes"] == (3 * 512 // 2 + 512) * 2 == 2560
    assert bf16["index_keys"]["bytes"] == (3 * 128 // 2 + 128) * 2 == 640
    # FP4 + an e4m3 byte per 16: 512 -> 256 + 32; FP4 + an e8m0 byte per 32: 128 -> 64 + 4
    assert packed["compressed"]["bytes"] == 3 * 288 // 2 + 288 == 720
    assert packed["index_keys"]["bytes"] == 3 * 68 // 2 + 68 == 170


def test_v41_per_sequence_caches(report):
    bf16, packed = (report["models"]["v41"]["caches"][s] for s in ("bf16", "packed"))
    assert bf16["window"]["bytes"] == 40 * (128 + 6) * 512 * 2 == 5488640
    assert packed["window"]["bytes"] == 40 * 134 * (512 + 16)  # FP8 + an e8m0 byte per 32
    assert bf16["compressor_state"]["layers"] == [2, 8, 14]  # ratio 1 pools nothing: no state
    assert bf16["compressor_state"]["bytes"] == 3 * (2 + 6) * (2 * 512) * 4  # fp32 kv | gate of 2 tokens + 6 spare
    assert bf16["engram_history"] == packed["engram_history"] | {"storage": "float32"}
    assert bf16["engram_history"]["layers"] == [1] and bf16["engram_history"]["bytes"] == (4 + 6) * 4  # ids, 6 spare


def test_sequence_totals(report):
    v41 = report["models"]["v41"]["sequences"]["1048576"]["bf16"]
    assert v41["total"] == 5488640 + 98304 + (4 + 6) * 4 + 1048576 * (2560 + 640)
    flash = report["models"]["v4_flash"]["caches"]["bf16"]
    assert flash["compressed"]["bytes"] == (21 * 512 // 4 + 20 * 512 // 128) * 2 == 5536
    assert flash["index_keys"]["bytes"] == 21 * 128 // 4 * 2
    assert flash["compressor_state"]["bytes"] == 21 * (8 + 6) * 2048 * 4 + 20 * (128 + 6) * 1024 * 4
    flash_total = report["models"]["v4_flash"]["sequences"]["131072"]["bf16"]["total"]
    assert flash_total > 2 * report["models"]["v41"]["sequences"]["131072"]["bf16"]["total"]


def test_engram_tables_and_rows(report):
    engram = report["engram"]
    assert engram["tables"]["values"] == (384006168 + 384016682) * 256  # the ~196.6B table parameters
    assert engram["tables"]["host_bytes"] == (384006168 + 384016682) * (256 + 256 // 32)
    assert engram["per_step"]["rows_per_token"] == 3 * 8 * 2  # (max_ngram - 1) x heads x engram layers
    assert engram["per_step"]["device_bytes_per_token_fp8_rows"] == 48 * 264
    assert engram["projections_per_layer"]["wkv_shape"] == [5 * 5120, 24 * 256]
