"""Weight bytes of DeepSeek-V4 Flash and V4.1 Flash in the formats DeepSeek releases them in, per layer and in all,
against bf16, and whether the formats hold what they promise (no weights loaded; CPU).

Formats as released (model/native_export.py writes the same): routed experts MXFP4 (4 bits a weight + one E8M0
byte per 32 = 4.25 bits); the projections DeepSeek ships in FP8 (attention's wq_a / wq_b / wkv / wo_a / wo_b, the
indexer's wq_b, shared experts, MTP's e_proj / h_proj) FP8 e4m3 + one E8M0 byte per block (V4: 128 x 128, V4.1:
32 x 32); V4.1's Engram tables FP8 + one E8M0 byte per 32 channels (host memory: counted apart); routers,
hyper-connection mixers, sinks and position biases float32; V4's hash tables int64; the rest bf16.

"Promised" = the bytes the format's definition gives for the tensor's shape; "held" = the `nbytes` of an
ops.MXFP4 / ops.BlockFP8 actually built (quantized from random values) for every distinct quantized shape of
the layer: they must be equal (the JSON records both). The configs are bench/v41_cache_bytes.py's (V4 Flash:
transformers' DeepseekV4Config() defaults with V4-Flash's compress ratios; V4.1: the released text config).

Run: python bench/weight_bytes.py --out bench/results/weight_bytes_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
import v41_cache_bytes  # noqa: E402
from _common import machine, versions  # noqa: E402

from deepinfer_core.backend.weight_formats import MXFP4, BlockFP8  # noqa: E402
from deepinfer_core.model.deepseek_v4 import FLOAT32_WEIGHTS_V4, expected_weights_v4  # noqa: E402
from deepinfer_core.model.deepseek_v41 import FLOAT32_WEIGHTS_V41, expected_weights_v41  # noqa: E402
from deepinfer_core.model.native_export import ENGRAM_TABLE, FP4_EXPERTS, FP8_PROJECTIONS  # noqa: E402

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def stored_format(name: str, float32: re.Pattern) -> str:
    if FP4_EXPERTS.search(name):
        return "mxfp4"
    if ENGRAM_TABLE.search(name):
        return "fp8_engram_table"
    if FP8_PROJECTIONS.search(name):
        return "fp8_block"
    if name.endswith("tid2eid"):
        return "int64"
    return "float32" if float32.search(name) else "bfloat16"


def promised_bytes(fmt: str, shape: tuple[int, ...], block: int) -> int:
    """The bytes format `fmt` defines for a weight of `shape`."""
    numel, rows, cols = math.prod(shape), math.prod(shape[:-1]), shape[-1]
    if fmt == "mxfp4":
        return numel // 2 + rows * (cols // 32)
    if fmt == "fp8_block":
        return numel + math.ceil(shape[-2] / block) * math.ceil(cols / block) * math.prod(shape[:-2])
    if fmt == "fp8_engram_table":
        return numel + rows * (cols // 32)
    return numel * {"int64": 8, "float32": 4, "bfloat16": 2}[fmt]


def held_bytes(fmt: str, shape: tuple[int, ...], block: int) -> int:
    """nbytes of the format's object built for `shape` (random values)."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    if fmt == "mxfp4":
        return MXFP4.quantize(values).nbytes
    blocks = (1, 32) if fmt == "fp8_engram_table" else (block, block)
    return BlockFP8.quantize(values, blocks, "e8m0").nbytes


def model_bytes(shapes: dict, float32: re.Pattern, block: int) -> dict:
    per_layer: dict[int, dict[str, int]] = {}
    totals: dict[str, int] = {}
    checked: dict[str, dict] = {}
    bf16 = 0
    for name, shape in shapes.items():
        fmt = stored_format(name, float32)
        nbytes = promised_bytes(fmt, shape, block)
        totals[fmt] = totals.get(fmt, 0) + nbytes
        if fmt != "fp8_engram_table":
            bf16 += math.prod(shape) * (8 if fmt == "int64" else 4 if fmt == "float32" else 2)
        layer = LAYER.match(name)
        if layer:
            per = per_layer.setdefault(int(layer[1]), {})
            per[fmt] = per.get(fmt, 0) + nbytes
        key = f"{fmt} {list(shape)}"
        if fmt in ("mxfp4", "fp8_block") and key not in checked:
            checked[key] = {"promised": nbytes, "held": held_bytes(fmt, shape, block)}
    engram = totals.pop("fp8_engram_table", 0)
    device = sum(totals.values())
    return {
        "bytes_by_format": totals,
        "device_bytes": device,
        "device_bytes_if_bf16": bf16,
        "device_ratio_to_bf16": device / bf16,
        "engram_table_bytes_host": engram,
        "per_layer": {str(k): {**v, "total": sum(v.values())} for k, v in sorted(per_layer.items())},
        "formats_hold_what_they_promise": all(c["promised"] == c["held"] for c in checked.values()),
        "checked_shapes": checked,
    }


def build_report() -> dict:
    configs = v41_cache_bytes.configs()
    report = {
        "benchmark": "weight_bytes",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine(),
        "versions": versions(),
        "method": __doc__.split("\n\n")[1],
        "models": {},
    }
    for key, family, block in (("v4_flash", "v4", 128), ("v41", "v41", 32)):
        cfg, source = configs[key]
        if family == "v4":
            shapes, float32 = expected_weights_v4(cfg), FLOAT32_WEIGHTS_V4
        else:
            shapes, float32 = expected_weights_v41(cfg), FLOAT32_WEIGHTS_V41
        report["models"][key] = {"config": source, "fp8_block": [block, block], **model_bytes(shapes, float32, block)}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/weight_bytes_cpu.json"))
    args = p.parse_args(argv)
    report = build_report()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for key, m in report["models"].items():
        gib = {fmt: round(n / 2**30, 2) for fmt, n in m["bytes_by_format"].items()}
        print(f"{key}: device {m['device_bytes'] / 2**30:.1f} GiB ({m['device_ratio_to_bf16']:.2f} of bf16) {gib}; "
              f"engram tables {m['engram_table_bytes_host'] / 2**30:.1f} GiB; formats hold their promise: "
              f"{m['formats_hold_what_they_promise']}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
