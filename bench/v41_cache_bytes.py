"""KV-cache and engram-table bytes of DeepSeek-V4.1 against DeepSeek-V4 at the released shapes, without weights.

The caches are the models' own declarations: every attention layer of each model is built (V41Attention,
V4Attention, and V4.1's NgramHasher for the engram look-back) over `meta` tensors shaped by
`expected_weights_v41` / `expected_weights_v4`, so no memory is touched; each layer's `cache_specs` are
then gathered the way DeepseekV41Model / DeepseekV4Model gather them (a group's compressed caches live on
its kv source only; the engram look-back on the first engram layer). Backbone layers only: V4's MTP layer
and V4.1's DSpark draft layers are not run by DeepInfer.

Configs:
- V4.1: `DeepseekV41Config.from_hf` with the released text config: the defaults (40 layers, ratios
  [0,0]+[2]*18+[1]*20, kv sources [2,8,14,20]) plus what they leave empty, engram_layer_ids [1, 14] and
  engram_num_embeddings [384006168, 384016682], and the release's YaRN rope_scaling
  (docs/deepseek_v41_reference.md §1.1).
- V4, two layouts. `v4_flash`: transformers 5.24's DeepseekV4Config() defaults (V4 Flash's sizes) with the
  layer schedule of DeepSeek-V4-Flash's config.json, compress_ratios [0,0]+[4,128]*20+[4] (+ 0 for the MTP
  layer): 2 sliding, 21 CSA, 20 HCA layers, as transcribed in public repositories (not fetched here).
  `v4_transformers_default`: the same defaults with transformers' own default layer_types, which its
  docstring calls the V4-Pro pattern (2 HCA, then CSA / HCA alternating: 20 CSA, 23 HCA, no sliding layer).

Storage, per cache kind: `bf16` is what the reference backend stores today (KV in the compute dtype,
compressor and look-back state in float32); `packed` stores the KV in the formats V4.1's rounding makes
lossless (v41_attention's WINDOW_FORMAT, ENTRY_FORMAT, INDEX_FORMAT: window FP8 e4m3 + an e8m0 byte per
32 values, compressed entries FP4 e2m1 + an e4m3 byte per 16, index keys FP4 + an e8m0 byte per 32) and
state as declared. V4's reference does not round its caches, so V4's `packed` figures are lossy: they
compare layouts, not what V4 could store exactly.

Sequence totals count one window ring and one state per sequence plus floor(L / ratio) entries per kv
source (paged caches are allocated in whole blocks, which adds nothing at the default lengths). Engram
tables: FP8 rows with an e8m0 byte per 32, in host memory; per step the device needs the rows gathered.
Engram projections and the other weights: parameter counts from the expected shapes (device).

Run: python bench/v41_cache_bytes.py --out bench/results/v41_cache_bytes.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import machine, versions  # noqa: E402

from deepinfer_core.kv.formats import BlockFormat  # noqa: E402
from deepinfer_core.kv.layout import CacheKind, CacheSpec  # noqa: E402
from deepinfer_core.model.config_v4 import DeepseekV4Config  # noqa: E402
from deepinfer_core.model.config_v41 import DeepseekV41Config  # noqa: E402
from deepinfer_core.model.deepseek_v4 import expected_weights_v4  # noqa: E402
from deepinfer_core.model.deepseek_v41 import expected_weights_v41  # noqa: E402
from deepinfer_core.model.v4_attention import ROLLBACK_SLOTS, V4Attention  # noqa: E402
from deepinfer_core.model.v41_attention import ENTRY_FORMAT, INDEX_FORMAT, WINDOW_FORMAT, V41Attention  # noqa: E402
from deepinfer_core.model.v41_engram import ENGRAM_STATE, NgramHasher  # noqa: E402

V41_RELEASED = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "rope_scaling": {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536
    },
}  # fmt: skip
V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # DeepSeek-V4-Flash config.json: 43 layers, then the MTP layer
LENGTHS = (131072, 1048576)
TABLE_FORMAT = ("fp8_e4m3/pow2:32", 32)  # released engram rows: F8_E4M3 + an F8_E8M0 scale per 32
PACKED_FORMATS = {"window": WINDOW_FORMAT, "compressed": ENTRY_FORMAT, "index_keys": INDEX_FORMAT}
UNITS = {CacheKind.PAGED: "token", CacheKind.SLIDING_WINDOW: "sequence", CacheKind.SEQUENCE_STATE: "sequence"}


def vector_bytes(fmt: tuple[str, int], values: int, unpacked_bytes: int) -> int:
    """Bytes of one vector packed in `fmt` (kv.formats' rows); the reference leaves vectors the block does not
    divide unrounded."""
    name, block = fmt
    return unpacked_bytes if values % block else BlockFormat.of(name).row_bytes(values)


# ---- the models' cache declarations, on meta tensors ----------------------------------------------


class _MetaWeights(dict):
    """name -> an empty `meta` tensor of the shape the config implies, made when first read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes = shapes

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = torch.empty(self.shapes[name], device="meta")
        return self[name]


def _meta_backend(dtype: torch.dtype) -> tuple[SimpleNamespace, dict]:
    """What the attention constructors read of a backend (no ops are called), and meta rope tables."""
    backend = SimpleNamespace(ops=None, attention=None, kv_layout=None, dtype=dtype, torch_device=torch.device("meta"))
    return backend, {name: (torch.empty(1, device="meta"),) * 2 for name in ("main", "compress")}


def v41_cache_specs(cfg: DeepseekV41Config, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, CacheSpec]]:
    """Each backbone layer's caches, as DeepseekV41Model declares them."""
    backend, ropes = _meta_backend(dtype)
    weights, built, specs = _MetaWeights(expected_weights_v41(cfg)), {}, []
    for i, plan in enumerate(cfg.layers):
        source = built.get(plan.kv_source) if plan.kv_source is not None else None
        built[i] = V41Attention(backend, cfg, weights, f"model.layers.{i}.attn", plan, ropes, source)
        specs.append(dict(built[i].cache_specs))
    if cfg.engram_layer_ids:  # the look-back's shape does not depend on the token map
        hasher = NgramHasher(backend, cfg, list(range(cfg.vocab_size)))
        specs[cfg.engram_layer_ids[0]][ENGRAM_STATE] = hasher.state_spec
    return specs


def v4_cache_specs(cfg: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, CacheSpec]]:
    """Each layer's caches, as DeepseekV4Model declares them."""
    backend, ropes = _meta_backend(dtype)
    weights = _MetaWeights(expected_weights_v4(cfg))
    layers = range(cfg.num_hidden_layers)
    return [dict(V4Attention(backend, cfg, weights, f"model.layers.{i}.attn", i, ropes).cache_specs) for i in layers]


# ---- bytes ---------------------------------------------------------------------------------------


def entry_bytes(name: str, spec: CacheSpec, packed: bool) -> int:
    """Bytes of one entry (PAGED), of one sequence's ring (SLIDING_WINDOW) or state (SEQUENCE_STATE)."""
    size = math.prod(spec.entry_shape) * spec.dtype.itemsize
    if packed and name in PACKED_FORMATS:
        vector = vector_bytes(PACKED_FORMATS[name], spec.head_dim, spec.head_dim * spec.dtype.itemsize)
        size = spec.num_heads * vector
    return size * (spec.ring_size if spec.kind is CacheKind.SLIDING_WINDOW else 1)


def cache_kinds(specs: list[dict[str, CacheSpec]], packed: bool) -> dict[str, dict]:
    """Per cache name: its unit, storage, the layers holding it, and bytes per unit (per token: summed
    over the kv sources of entry bytes / ratio; per sequence: summed over the layers)."""
    kinds: dict[str, dict] = {}
    for layer, caches in enumerate(specs):
        for name, spec in caches.items():
            storage = PACKED_FORMATS[name][0] if packed and name in PACKED_FORMATS else spec.dtype
            storage = str(storage).removeprefix("torch.")
            kind = kinds.setdefault(name, {"unit": UNITS[spec.kind], "storage": storage, "layers": [], "bytes": 0})
            size = entry_bytes(name, spec, packed)
            kind["layers"].append(layer)
            kind.setdefault("entry_bytes", {})[str(layer)] = size
            kind["bytes"] += size / spec.compress_rate if spec.kind is CacheKind.PAGED else size
    for kind in kinds.values():
        kind["bytes"] = int(kind["bytes"]) if float(kind["bytes"]).is_integer() else kind["bytes"]
    return kinds


def sequence_bytes(specs: list[dict[str, CacheSpec]], length: int, packed: bool) -> dict[str, int]:
    """Bytes one sequence of `length` tokens holds, per cache name and in total."""
    out: dict[str, int] = {}
    for caches in specs:
        for name, spec in caches.items():
            count = length // spec.compress_rate if spec.kind is CacheKind.PAGED else 1
            out[name] = out.get(name, 0) + count * entry_bytes(name, spec, packed)
    out["total"] = sum(out.values())
    return out


def model_report(specs: list[dict[str, CacheSpec]], source: str, lossless: bool, lengths) -> dict:
    return {
        "source": source,
        "layers": len(specs),
        "packed_is_lossless": lossless,
        "caches": {storage: cache_kinds(specs, storage == "packed") for storage in ("bf16", "packed")},
        "sequences": {
            str(n): {storage: sequence_bytes(specs, n, storage == "packed") for storage in ("bf16", "packed")}
            for n in lengths
        },
    }


def engram_report(cfg: DeepseekV41Config, step_tokens: int = 8192) -> dict:
    """Engram tables (host) vs the rows a step gathers and the per-layer projections (device)."""
    dim = cfg.engram_head_dim
    row_fp8, row_bf16 = vector_bytes(TABLE_FORMAT, dim, 2 * dim), 2 * dim
    rows = list(cfg.engram_num_embeddings)
    gathered = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * len(cfg.engram_layer_ids)  # per token
    wkv = ((cfg.hc_mult + 1) * cfg.hidden_size, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * dim)
    small = 2 * cfg.hc_mult * cfg.hidden_size  # q_weight, k_weight
    return {
        "layers": list(cfg.engram_layer_ids),
        "tables": {
            "rows": rows,
            "values": sum(rows) * dim,
            "row_bytes_fp8_with_scales": row_fp8,
            "host_bytes_per_table": [r * row_fp8 for r in rows],
            "host_bytes": sum(rows) * row_fp8,
            "host_bytes_if_bf16": sum(rows) * row_bf16,
        },
        "per_step": {
            "rows_per_token": gathered,
            "device_bytes_per_token_fp8_rows": gathered * row_fp8,
            "device_bytes_per_token_bf16_rows": gathered * row_bf16,
            "example_step_tokens": step_tokens,
            "device_bytes_example_step_fp8_rows": step_tokens * gathered * row_fp8,
            "note": "upper bound: repeated n-grams in a step gather the same row",
        },
        "projections_per_layer": {
            "wkv_shape": list(wkv),
            "params": math.prod(wkv) + small,
            "device_bytes_bf16": 2 * (math.prod(wkv) + small),
            "device_bytes_fp8_wkv": math.prod(wkv) + 2 * small,  # + block scales (1 byte per block)
        },
    }


def weights_report(cfg: DeepseekV41Config) -> dict:
    """Parameters of the V4.1 backbone by part, from the expected shapes; bf16 as the loader holds them today."""
    parts = {"engram_tables": ".engram.embed.", "engram_other": ".engram.", "routed_experts": ".ffn.experts.",
             "shared_experts": ".ffn.shared_experts.", "router": ".ffn.gate.", "attention": ".attn.",
             "hyper_connections": ".hc_", "embed_head_norms": ""}  # fmt: skip
    params = dict.fromkeys(parts, 0)
    for name, shape in expected_weights_v41(cfg).items():
        part = next((p for p, key in parts.items() if key and key in name), "embed_head_norms")
        params[part] += math.prod(shape)
    experts = params["routed_experts"]
    return {
        "params": params,
        "params_total": sum(params.values()),
        "params_device": sum(params.values()) - params["engram_tables"],
        "bf16_bytes_device": 2 * (sum(params.values()) - params["engram_tables"]),
        "routed_experts_fp4_bytes": experts // 2 + experts // 32,  # released: e2m1 + an e8m0 byte per 32
    }


# ---- configs, report, table ----------------------------------------------------------------------


def configs() -> dict[str, tuple[object, str]]:
    from transformers import DeepseekV4Config as HFDeepseekV4Config

    hf = HFDeepseekV4Config().to_dict()
    flash = {k: v for k, v in hf.items() if k != "layer_types"} | {"compress_ratios": V4_FLASH_RATIOS}
    return {
        "v4_flash": (DeepseekV4Config.from_hf(flash), "transformers DeepseekV4Config() + V4-Flash compress_ratios"),
        "v4_transformers_default": (DeepseekV4Config.from_hf(hf), "transformers 5.24 DeepseekV4Config() defaults"),
        "v41": (DeepseekV41Config.from_hf(V41_RELEASED), "DeepseekV41Config defaults + engram layers [1, 14]"),
    }


def _commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def build_report(lengths=LENGTHS) -> dict:
    report = {
        "benchmark": "v41_cache_bytes",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine(),
        "versions": versions(),
        "commit": _commit(),
        "rollback_slots": ROLLBACK_SLOTS,
        "packed_formats": {name: fmt[0] for name, fmt in PACKED_FORMATS.items()},
        "models": {},
    }
    for key, (cfg, source) in configs().items():
        is_v41 = isinstance(cfg, DeepseekV41Config)
        specs = v41_cache_specs(cfg) if is_v41 else v4_cache_specs(cfg)
        report["models"][key] = model_report(specs, source, is_v41, lengths)
        if is_v41:
            report["engram"], report["weights_v41"] = engram_report(cfg), weights_report(cfg)
    return report


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.4g} B"


ROWS = (
    ("window", "window ring", "sequence"),
    ("compressed", "compressed entries", "token"),
    ("index_keys", "index keys", "token"),
    ("compressor_state", "compressor state", "sequence"),
    ("index_state", "index compressor state", "sequence"),
    (ENGRAM_STATE, "engram look-back", "sequence"),
)


def table(report: dict) -> str:
    models = report["models"]
    columns = [(m, s) for m in ("v4_transformers_default", "v4_flash", "v41") for s in ("bf16", "packed")]
    heads = {"v4_transformers_default": "V4 default", "v4_flash": "V4 Flash", "v41": "V4.1"}

    def row(label: str, cells: list) -> str:
        shown = [c if isinstance(c, str) else "-" if c is None else human(c) for c in cells]
        return f"{label:38}" + "".join(f"{c:>18}" for c in shown)

    lines = [row("cache kind (per unit)", [f"{heads[m]} {s}" for m, s in columns])]
    for name, label, unit in ROWS:
        cells = [models[m]["caches"][s].get(name, {}).get("bytes") for m, s in columns]
        lines.append(row(f"{label} (per {unit})", cells))
    for n in models["v41"]["sequences"]:
        cells = [models[m]["sequences"][n][s]["total"] for m, s in columns]
        lines.append(row(f"KV of a {int(n):,}-token sequence", cells))
    engram, weights = report["engram"], report["weights_v41"]
    lines += [
        "(V4 packed: V4.1's formats applied to V4's layout; lossy, V4's reference does not round its caches)",
        f"engram tables (host, FP8 + e8m0/32): {engram['tables']['values'] / 1e9:.1f}B values, "
        f"{human(engram['tables']['host_bytes'])} ({engram['tables']['host_bytes'] / 1e9:.1f} GB)",
        f"engram rows gathered per token: {engram['per_step']['rows_per_token']} = "
        f"{human(engram['per_step']['device_bytes_per_token_fp8_rows'])} FP8 "
        f"({human(engram['per_step']['device_bytes_per_token_bf16_rows'])} as bf16)",
        f"engram projections per layer (device): {engram['projections_per_layer']['params'] / 1e6:.1f}M params, "
        f"{human(engram['projections_per_layer']['device_bytes_bf16'])} bf16",
        f"V4.1 weights besides the tables (device): {weights['params_device'] / 1e9:.1f}B params, "
        f"{human(weights['bf16_bytes_device'])} bf16; routed experts {weights['params']['routed_experts'] / 1e9:.1f}B "
        f"({human(weights['routed_experts_fp4_bytes'])} as released FP4)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "v41_cache_bytes.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths (tokens)")
    args = parser.parse_args(argv)
    report = build_report(args.lengths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
