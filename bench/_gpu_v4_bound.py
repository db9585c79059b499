"""Bounds of gpu_decode.py's DeepSeek-V4 / V4.1 runs: the weight bytes our model holds, the cache bytes a decode
step reads (from the model's cache_specs, as nvidia_sm100's PackedKVLayout stores them: V4.1's KV in its FP8 / FP4
stored_format, the rest in its dtype), the flops; the report's summary and table."""

from __future__ import annotations

import math

import torch
from _gpu_measure import prefill_bound_record, token_match

from deepinfer_core.kv.caches import block_bytes, sequence_bytes
from deepinfer_core.kv.layout import CacheKind, CacheSpec
from deepinfer_core.kv.packed import PackedKVLayout
from deepinfer_core.model.config_v4 import CSA

# ---- weights ------------------------------------------------------------------------------------


def _held_float32(family, cfg, name: str) -> bool:
    """Weights our model holds (and reads) in float32: the family's FLOAT32 set, and V4.1's ratio > 1
    compressors, which project in float32 (GroupCompressor.w_kv_gate)."""
    if family.float32_weights.search(name):
        return True
    if family.name == "v41" and name.endswith((".compressor.wkv.weight", ".compressor.wgate.weight")):
        return cfg.layers[int(name.split(".")[2])].ratio > 1
    return False


def weight_sizes(family, cfg, dtype: torch.dtype) -> dict:
    """Parameter counts and bytes by kind, from the shapes our model reads."""
    counts = {"embedding": 0, "lm_head": 0, "routed_experts": 0, "hash_tables": 0, "other": 0}
    nbytes = dict.fromkeys(counts, 0)
    for name, shape in family.expected_weights(cfg).items():
        numel = math.prod(shape)
        if name.endswith("tid2eid"):
            kind, item = "hash_tables", 8  # int64 token -> experts tables: only the batch's rows are read
        else:
            kind = "other"
            if name in ("model.embed_tokens.weight", "model.embed.weight"):
                kind = "embedding"
            elif name in ("head.weight", "lm_head.weight"):
                kind = "lm_head"
            elif ".ffn.experts." in name:
                kind = "routed_experts"
            item = 4 if _held_float32(family, cfg, name) else dtype.itemsize
        counts[kind] += numel
        nbytes[kind] += numel * item
    layers, experts, top_k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = counts["routed_experts"] // (layers * experts)
    lm_head = counts["lm_head"] or counts["embedding"]
    return {
        "params": counts,
        "params_total": sum(counts.values()),
        "moe_layers": layers,
        "hash_layers": sum(t == "hash_moe" for t in getattr(cfg, "mlp_layer_types", ())),
        "params_per_expert": per_expert,
        "active_params_per_token": counts["other"] + lm_head + layers * top_k * per_expert,
        "lm_head_params": lm_head,
        "itemsize": dtype.itemsize,
        "weight_format": str(dtype).removeprefix("torch."),
        "bytes": nbytes,
        "bytes_total": sum(nbytes.values()),
        "other_bytes": nbytes["other"],
        "lm_head_bytes": nbytes["lm_head"] or nbytes["embedding"],
        "bytes_per_expert": nbytes["routed_experts"] / (layers * experts),
        "note": "float32: routers, hyper-connection mixers, sinks, compressor position biases (and V4.1's ratio > 1 "
        "compressor projections, held float32 by the model); hash tables int64; the rest the compute dtype",
    }


# ---- caches -------------------------------------------------------------------------------------


STORED = PackedKVLayout(torch.device("meta"))  # entry bytes only: it allocates nothing here


def _entry_bytes(spec: CacheSpec) -> int:
    return STORED.entry_bytes(spec)


def _storage(spec: CacheSpec) -> str:
    return spec.stored_format or str(spec.dtype).removeprefix("torch.")


def _readers(family, cfg, layer: int, name: str, spec: CacheSpec, context: int) -> list[tuple[int, int]]:
    """[(layer reading it, entries read per sequence)] of cache `name` held by `layer`, at `context` tokens."""
    if spec.kind is CacheKind.SEQUENCE_STATE:
        return [(layer, 1)]  # gathered whole every step
    if spec.kind is CacheKind.SLIDING_WINDOW:
        return [(layer, min(context, spec.window))]
    entries = context // spec.compress_rate
    if family.name == "v4":  # a layer's compressed caches are its own
        if name == "index_keys":
            return [(layer, entries)]  # the indexer scores every key
        top_k = cfg.layer_types[layer] == CSA
        return [(layer, min(cfg.index_topk, entries) if top_k else entries)]  # CSA: the top-k; HCA: all
    plans = cfg.layers  # V4.1: the group's caches live on its kv source, the layers of the group read them
    group = [p for p in plans if p.kv_source == layer]
    if name == "index_keys":  # each index source scores the keys (after the candidate source: within its blocks)
        within = cfg.candidate_topk_blocks * cfg.candidate_block_size
        return [(p.layer, min(entries, within) if p.uses_candidates else entries) for p in group if p.is_index_source]
    return [(p.layer, min(cfg.index_topk, entries)) for p in group if p.index_source is not None]


def cache_reads(family, cfg, specs, context: int) -> dict:
    """Per cache name: entries and bytes one sequence's decode step reads at `context` tokens, the layers
    holding and reading it, its stored dtype."""
    reads: dict[str, dict] = {}
    for layer, caches in enumerate(specs):
        for name, spec in caches.items():
            info = reads.setdefault(
                name,
                {"kind": spec.kind.value, "storage": _storage(spec), "held_by": []},
            )
            info["held_by"].append(layer)
            for reader, entries in _readers(family, cfg, layer, name, spec, context):
                info.setdefault("read_by", []).append(reader)
                info["entries"] = info.get("entries", 0) + entries
                info["bytes"] = info.get("bytes", 0) + entries * _entry_bytes(spec)
    return reads


def attention_flops(cfg, reads: dict) -> float:
    """Per token: scores and values over the entries attended (window + compressed: 4 x H x Dh each), and
    the indexer's scores over the keys it reads (2 x Hi x Di each)."""
    attended = sum(reads.get(name, {}).get("entries", 0) for name in ("window", "compressed"))
    keys = reads.get("index_keys", {}).get("entries", 0)
    return 4 * cfg.num_attention_heads * cfg.head_dim * attended + 2 * cfg.index_n_heads * cfg.index_head_dim * keys


def cache_report(specs, block_size: int, source: str) -> dict:
    """What each layer caches (the model's declarations) and what a sequence slot and a block hold."""
    layers = [
        {
            name: {
                "kind": s.kind.value,
                "dtype": str(s.dtype).removeprefix("torch."),
                **({"stored_format": s.stored_format} if s.stored_format else {}),
                "entry_shape": list(s.entry_shape),
                **({"compress_rate": s.compress_rate} if s.kind is CacheKind.PAGED else {}),
                **({"window": s.window, "ring_size": s.ring_size} if s.kind is CacheKind.SLIDING_WINDOW else {}),
            }
            for name, s in caches.items()
        }
        for caches in specs
    ]
    return {
        "specs_from": source,
        "layers": layers,
        "sequence_slot_bytes": sequence_bytes(specs, STORED),  # rings (window + rollback slots) and states
        "block_bytes": block_bytes(specs, block_size, STORED),
        "block_size": block_size,
    }


# ---- bounds -------------------------------------------------------------------------------------


def decode_step_bound(family, cfg, sizes: dict, specs, batch: int, context: float, bw: float, peak: float) -> dict:
    """Lower bound on one decode step of `batch` sequences of mean `context` tokens."""
    experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = experts * (1 - (1 - top_k / experts) ** batch)  # uniform-routing expectation
    weights = (
        sizes["other_bytes"]
        + sizes["lm_head_bytes"]
        + sizes["moe_layers"] * touched * sizes["bytes_per_expert"]
        + batch * cfg.hidden_size * sizes["itemsize"]  # the embedding rows gathered
        + batch * sizes["hash_layers"] * top_k * 8  # the hash tables' rows
    )
    reads = cache_reads(family, cfg, specs, int(context))
    cache = batch * sum(r.get("bytes", 0) for r in reads.values())
    flops = batch * (2 * sizes["active_params_per_token"] + attention_flops(cfg, reads))
    memory_s, compute_s = (weights + cache) / bw, flops / peak
    return {
        "expected_experts_touched_per_layer": touched,
        "weight_bytes": weights,
        "kv_bytes": cache,
        "kv_bytes_by_cache": {name: batch * r.get("bytes", 0) for name, r in reads.items()},
        "flops": flops,
        "memory_bound_ms": 1e3 * memory_s,
        "compute_bound_ms": 1e3 * compute_s,
        "bound_ms": 1e3 * max(memory_s, compute_s),
        "bound_tokens_per_s": batch / max(memory_s, compute_s),
    }


def prefill_bound(family, cfg, sizes: dict, specs, prompts: int, length: int, peak: float, bw: float) -> dict:
    """Lower bound on prefilling `prompts` x `length` tokens (one next-token logit row per prompt): flops =
    2 x (active params - lm_head) x tokens + 2 x lm_head x prompts + per prompt the sum over positions t of
    attention_flops at context t; or all weights once / bandwidth if larger."""
    tokens, head = prompts * length, sizes["lm_head_params"]
    dense = 2 * (sizes["active_params_per_token"] - head) * tokens + 2 * head * prompts
    attention = prompts * sum(attention_flops(cfg, cache_reads(family, cfg, specs, t)) for t in range(1, length + 1))
    return prefill_bound_record(tokens, dense, attention, sizes, peak, bw)


# ---- report -------------------------------------------------------------------------------------


def summarise(report: dict, family, cfg, specs) -> None:
    """Add the bounds (with what they count), each result's fraction of its bound, and the comparisons."""
    work, sizes = report["workload"], report["params"]
    bw = report["measurements"]["copy_bandwidth"]["gb_per_s"] * 1e9
    peak = report["measurements"]["gemm"]["tflop_per_s"] * 1e12
    context = work["prompt_len"] + work["new_tokens"] / 2  # mean context over the decode steps
    bound = {str(b): decode_step_bound(family, cfg, sizes, specs, b, context, bw, peak) for b in work["batches"]}
    prefill = prefill_bound(family, cfg, sizes, specs, *work["prefill"], peak, bw)
    report["bound"] = {
        "note": "decode, per step: (weight bytes + cache bytes read) / measured copy bandwidth; compute = flops / "
        "measured GEMM peak; bound = the larger. Prefill: flops / GEMM peak, or all weights once / bandwidth if "
        "larger (prefill_bound, bench/_gpu_v4_bound.py).",
        "counted": {
            "weights": "every weight but the embedding, routed experts and hash tables (attention, compressors, "
            "indexers, shared experts, routers, hyper-connection mixers, norms, lm_head), in the dtype our model "
            "holds it (params.note); E(1 - (1 - k/E)^B) routed experts per MoE layer (the expected number touched "
            "under UNIFORM routing; the hash-routed layer's random table routes about uniformly too); B embedding "
            "rows and B x k hash-table rows per hash layer",
            "caches": "per sequence, from the model's cache_specs in their stored dtype (cache.layers): each layer "
            "reads min(ctx, window) entries of its window ring; compressed entries: V4 CSA the indexer's top-k, "
            "HCA all ctx / rate; V4.1 every attending layer of a group the top-k of its group's entries; index "
            "keys: all ctx / rate of them per indexer (V4.1: per index source; after the candidate source at most "
            "candidate_topk_blocks x candidate_block_size); compressor / indexer states whole",
            "mean_decode_context": context,
            "per_sequence_cache_reads": cache_reads(family, cfg, specs, int(context)),
            "flops": "2 x active params per token (attention, compressors, indexers, shared and top-k experts, "
            "lm_head) + 4 x heads x head_dim per attended entry + 2 x index heads x index dim per scored key",
            "not_counted": "cache writes (one window entry per layer and token, finished compressed entries, states "
            "written back), activations, the rotary tables",
        },
        "decode": bound,
        "prefill": prefill,
    }
    decode = report["decode"]
    for per_batch in decode.values():
        for b, r in per_batch.items():
            r["fraction_of_bound"] = bound[b]["bound_ms"] / r["ms_per_step"]
            r["fraction_of_memory_bound"] = bound[b]["memory_bound_ms"] / r["ms_per_step"]
    for r in report["prefill"].values():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["tflop_per_s"] = prefill["flops"] / r["seconds"] / 1e12
        r["fraction_of_bound"] = prefill["bound_ms"] / 1e3 / r["seconds"]
    ours, hf = decode.get("ours_default", {}), decode.get("hf", {})
    both = "ours_default" in report["prefill"] and "hf" in report["prefill"]
    report["comparisons"] = {
        "speedup_vs_hf": {b: hf[b]["ms_per_step"] / r["ms_per_step"] for b, r in ours.items() if b in hf},
        "prefill_speedup_vs_hf": report["prefill"]["hf"]["seconds"] / report["prefill"]["ours_default"]["seconds"]
        if both
        else None,
        "token_match_vs_hf": {b: token_match(r["tokens"], hf[b]["tokens"]) for b, r in ours.items() if b in hf},
        "note": "token_match_vs_hf: greedy tokens of the timed runs (same prompts, benchmark dtype); informational",
    }
    for per_batch in decode.values():
        for r in per_batch.values():
            r.pop("tokens")


def print_table(report: dict) -> None:
    decode, bound = report["decode"], report["bound"]

    def cell(key: str, b: str, field: str, width: int, digits: int) -> str:
        value = decode.get(key, {}).get(b, {}).get(field)
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(
        f"\n{report['model']['title']}: {'batch':>5} {'bound ms':>9} | {'ours ms':>8} {'tok/s':>8} {'x bound':>7} | "
        f"{'hf ms':>8} {'tok/s':>7} {'x bound':>7} | {'vs hf':>6}"
    )
    for b in map(str, report["workload"]["batches"]):
        vs = report["comparisons"]["speedup_vs_hf"].get(b)
        print(
            f"{'':>{len(report['model']['title']) + 1}} {b:>5} {bound['decode'][b]['bound_ms']:>9.2f} | "
            f"{cell('ours_default', b, 'ms_per_step', 8, 2)} {cell('ours_default', b, 'tokens_per_s', 8, 0)} "
            f"{cell('ours_default', b, 'fraction_of_bound', 7, 2)} | {cell('hf', b, 'ms_per_step', 8, 2)} "
            f"{cell('hf', b, 'tokens_per_s', 7, 0)} {cell('hf', b, 'fraction_of_bound', 7, 2)} | "
            + (f"{vs:>6.2f}" if vs is not None else f"{'-':>6}")
        )
    p = bound["prefill"]
    print(f"prefill {p['tokens']} tokens, bound {p['bound_ms']:.1f} ms:")
    for key, r in report["prefill"].items():
        print(f"  {key}: {r['tokens_per_s']:.0f} tok/s, {r['tflop_per_s']:.1f} TFLOP/s, {r['fraction_of_bound']:.2f}")
    if report["hf_agreement"]:
        print(f"greedy agreement with transformers (tiny float32): {report['hf_agreement']['hf_agreement']:.3f}")
    if not report["hf"]["available"]:
        print(f"transformers baseline: none ({report['hf']['reason']})")
