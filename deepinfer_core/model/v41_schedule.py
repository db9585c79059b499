"""DeepSeek-V4.1's per-layer attention schedule (CED + CSA2): its defaults, its checks, and one plan per layer.

`compress_ratios` says what each layer attends beyond its sliding window; kv sources own a compressor and
publish their group's compressed KV; index sources pick the top-k entries the layers after them reuse;
the candidate source's block mask narrows every later index source. Defaults and the first checks follow
transformers' DeepseekV41TextConfig; the rest refuse the schedules it runs oddly
(docs/deepseek_v41_reference.md §3.5, E1-E3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from deepinfer_core.model.config import ConfigError

__all__ = [
    "DEFAULT_COMPRESS_RATIOS",
    "DEFAULT_INDEX_SOURCES",
    "DEFAULT_KV_SOURCES",
    "LayerPlan",
    "Schedule",
    "default_compress_ratios",
    "derive_schedule",
    "layer_plans",
]

DEFAULT_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20  # the released 40 layers
DEFAULT_KV_SOURCES = (2, 8, 14, 20)
DEFAULT_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
SLIDING, SHARED_COMPRESSED = "sliding_attention", "shared_compressed_attention"


@dataclass(frozen=True, slots=True)
class Schedule:
    compress_ratios: tuple[int, ...]  # backbone layers, then draft layers
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0: no two-level top-k
    dspark_target_layer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What one backbone layer does, derived once from the schedule."""

    layer: int
    ratio: int  # 0: sliding window only; 1: one compressed entry per token; r > 1: r tokens pooled
    kv_source: int | None  # the layer whose compressed KV this layer reads (its group); None when ratio is 0
    index_source: int | None  # whose top-k it attends: the last index source of its group at or before it
    is_kv_source: bool  # owns a compressor and publishes the group's compressed KV
    is_index_source: bool  # runs the indexer and publishes top-k indices
    owns_index_keys: bool  # kv source and index source: projects the group's index keys
    reindex: bool  # index source that scores with its own weights against its kv source's keys
    is_candidate_source: bool  # its block mask constrains every later index source
    uses_candidates: bool  # index source after the candidate source
    rope: str  # "main" (ratio 0) or "compress"
    engram: bool
    layer_type: str  # transformers' cache dispatch: SHARED_COMPRESSED on kv sources, else SLIDING


def default_compress_ratios(n: int) -> tuple[int, ...]:
    """The released schedule for 40 layers; otherwise its shape scaled to n: two sliding layers, ratio-2
    encoder layers (the larger half of the rest), then ratio-1 decoder layers."""
    if n == len(DEFAULT_COMPRESS_RATIOS):
        return DEFAULT_COMPRESS_RATIOS
    n_slide = min(2, n)
    n_enc = max(0, (n - n_slide + 1) // 2)
    return (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)


def _group_starts(ratios: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r))


def _fail(message: str) -> NoReturn:
    raise ConfigError(f"config.json describes a DeepSeek-V4.1 schedule DeepInfer cannot build: {message}")


def _check_ids(name: str, ids: tuple[int, ...], n: int, hint: str = "") -> None:
    if list(ids) != sorted(set(ids)):
        _fail(f"{name} {list(ids)} must list distinct layers in increasing order")
    if any(not 0 <= i < n for i in ids):
        _fail(f"{name} {list(ids)} names layers outside 0..{n - 1} (num_hidden_layers is {n}){hint}")


def derive_schedule(
    n: int,
    n_nextn: int,
    compress_ratios: tuple[int, ...] | None,
    kv_sources: tuple[int, ...] | None,
    index_sources: tuple[int, ...] | None,
    candidate: int | None,
    dspark_targets: tuple[int, ...] | None,
) -> Schedule:
    """Fill in the defaults the way transformers does, then refuse what the model cannot run."""
    ratios = default_compress_ratios(n) if compress_ratios is None else compress_ratios
    if not n <= len(ratios) <= n + n_nextn:
        _fail(
            f"compress_ratios has {len(ratios)} entries; give one per layer: num_hidden_layers ({n}) entries, "
            f"optionally followed by up to num_nextn_predict_layers ({n_nextn}) draft-layer entries"
        )
    if any(r < 0 for r in ratios):
        _fail(f"compress_ratios {list(ratios)} holds a negative ratio; use 0 (sliding only), 1, or r > 1")
    ratios = ratios + (0,) * (n + n_nextn - len(ratios))  # draft layers are sliding only
    backbone = ratios[:n]

    hint = ""
    if kv_sources is None:
        if backbone == DEFAULT_COMPRESS_RATIOS[:n]:
            kv_sources = DEFAULT_KV_SOURCES
            hint = " (the released default, taken because compress_ratios matches the released schedule's start; "
            hint += "set kv_source_layer_ids, and usually compress_ratios, explicitly)"
        else:
            kv_sources = _group_starts(backbone)
    if index_sources is None:
        index_sources = DEFAULT_INDEX_SOURCES if kv_sources == DEFAULT_KV_SOURCES else kv_sources
    if dspark_targets is None:
        dspark_targets = tuple(sorted([i for i in range(n) if i not in kv_sources][-3:]))

    _check_ids("kv_source_layer_ids", kv_sources, n, hint)
    if zero := [i for i in kv_sources if backbone[i] == 0]:
        _fail(f"kv_source_layer_ids {list(kv_sources)} names layers {zero} whose compress_ratios entry is 0")
    _check_ids("index_source_layer_ids", index_sources, n)
    if zero := [i for i in index_sources if backbone[i] == 0]:
        _fail(f"index_source_layer_ids {list(index_sources)} names layers {zero} whose compress_ratios entry is 0")
    if early := [i for i in index_sources if not any(s <= i for s in kv_sources)]:
        _fail(
            f"index_source_layer_ids {early} come before every kv_source_layer_ids entry {list(kv_sources)}; "
            "an index source scores the keys of a kv source at or before it"
        )
    if candidate is None:
        candidate = kv_sources[-1] if kv_sources else -1
    if candidate >= 0 and candidate not in index_sources:
        _fail(
            f"candidate_source_layer_id {candidate} is not one of index_source_layer_ids {list(index_sources)}; "
            "name an index source, or -1 to turn the two-level top-k off"
        )
    if orphans := [i for i in range(n) if backbone[i] > 0 and not any(s <= i for s in kv_sources)]:
        _fail(
            f"layers {orphans} have compress_ratios > 0 but no kv_source_layer_ids entry at or before them; "
            "make the first layer of each group a kv source"
        )
    _check_groups(backbone, kv_sources, index_sources, candidate)
    _check_ids("dspark_target_layer_ids", dspark_targets, n)
    return Schedule(ratios, kv_sources, index_sources, candidate, dspark_targets)


def _source_of(layer: int, kv_sources: tuple[int, ...]) -> int | None:
    return max((s for s in kv_sources if s <= layer), default=None)


def _check_groups(backbone, kv_sources, index_sources, candidate) -> None:
    for layer, ratio in enumerate(backbone):  # E1
        source = _source_of(layer, kv_sources)
        if ratio > 0 and backbone[source] != ratio:
            _fail(
                f"layer {layer} has compress_ratios {ratio} but reads the compressed KV of kv source {source}, "
                f"whose ratio is {backbone[source]}; start a new group there (add {layer} to kv_source_layer_ids) "
                "or give it its group's ratio"
            )
    for source in kv_sources:  # E3
        if source in index_sources:
            continue
        if later := [i for i in index_sources if _source_of(i, kv_sources) == source]:
            _fail(
                f"kv source {source} is not in index_source_layer_ids but index sources {later} of its group need "
                f"the index keys only a layer that is both projects; add {source} to index_source_layer_ids"
            )
    if candidate >= 0:  # E2
        group = _source_of(candidate, kv_sources)
        if others := [i for i in index_sources if i > candidate and _source_of(i, kv_sources) != group]:
            _fail(
                f"index sources {others} come after candidate_source_layer_id {candidate} but read another group's "
                f"compressed KV than its group (kv source {group}), so its candidate blocks do not apply to them; "
                "move the candidate source to their group, or set candidate_source_layer_id to -1"
            )


def layer_plans(schedule: Schedule, n: int, engram_layer_ids: tuple[int, ...]) -> tuple[LayerPlan, ...]:
    kv, index, candidate = (
        schedule.kv_source_layer_ids,
        schedule.index_source_layer_ids,
        schedule.candidate_source_layer_id,
    )
    plans = []
    for layer in range(n):
        ratio = schedule.compress_ratios[layer]
        source = _source_of(layer, kv) if ratio > 0 else None
        picks = [i for i in index if source is not None and source <= i <= layer]
        plans.append(
            LayerPlan(
                layer=layer,
                ratio=ratio,
                kv_source=source,
                index_source=picks[-1] if picks else None,
                is_kv_source=layer in kv,
                is_index_source=layer in index,
                owns_index_keys=layer in kv and layer in index,
                reindex=layer in index and layer not in kv,
                is_candidate_source=layer == candidate,
                uses_candidates=layer in index and 0 <= candidate < layer,
                rope="compress" if ratio > 0 else "main",
                engram=layer in engram_layer_ids,
                layer_type=SHARED_COMPRESSED if layer in kv else SLIDING,
            )
        )
    return tuple(plans)
