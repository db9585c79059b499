"""The report of serve_load.py: latency statistics, one level's results, the workload description, the table."""

from __future__ import annotations

import importlib.metadata
import math
from collections import Counter
from dataclasses import dataclass

from _common import median, versions
from _serving import gauge_summary, metrics_delta


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    if q == 50:
        return median(values)
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: list[float]) -> dict:
    """Count, mean, p50 / p90 / p99 and max; None everywhere but the count for no values."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


@dataclass(frozen=True, slots=True)
class LevelRun:
    """What one concurrency level measured: the client records, and the server as seen around them."""

    concurrency: int
    records: list[dict]  # one_request's record per request, in prompt order
    wall_seconds: float  # first send -> last [DONE]
    client_cpu_seconds: float
    server_cpu_seconds: float | None  # None for a server this benchmark did not start
    metrics_before: dict | None  # /metrics scraped before and after the level; None where it did not answer
    metrics_after: dict | None
    gauge_samples: list  # (kv_blocks_used, requests_running, requests_waiting) sampled while the level ran


def level_result(run: LevelRun, max_tokens: int) -> dict:
    """One entry of the report's "levels": throughput, latency statistics, and the server's own counters."""
    records, wall = run.records, run.wall_seconds
    ok = [r for r in records if r["ok"]]
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    server_delta = metrics_delta(run.metrics_before, run.metrics_after)
    usage_all = sum(r.get("completion_tokens") or 0 for r in records)
    server_gen = server_delta["generation_tokens"] if server_delta else None
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    return {
        "concurrency": run.concurrency,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(Counter(r["error"].split(":")[0] for r in records if r["error"])),
        "error_examples": sorted({r["error"] for r in records if r["error"]})[:5],
        "wall_seconds": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens_per_request": summary(prompt_tokens),
        "completion_tokens_per_request": summary([r["completion_tokens"] for r in ok]),
        "output_deltas_per_request": summary([r["content_deltas"] for r in ok]),
        "output_delta_kinds": dict(sum((Counter(r["delta_kinds"]) for r in ok), Counter())),
        "requests_with_fewer_usage_tokens_than_max_tokens_at_finish_length": sum(
            1 for r in ok if r.get("finish_reason") == "length" and (r["completion_tokens"] or 0) < max_tokens
        ),
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in ok)),
        "prefix_cached_tokens": cached,
        "prefix_cached_fraction_of_prompt_tokens": cached / sum(prompt_tokens) if prompt_tokens else None,
        "ttft_s": summary([r["ttft_s"] for r in ok]),
        "tbt_s": summary([g for r in ok for g in r["gaps_s"]]),
        "tpot_s": summary([r["tpot_s"] for r in ok if "tpot_s" in r]),
        "latency_s": summary([r["latency_s"] for r in ok]),
        "client_cpu_seconds": run.client_cpu_seconds,
        "server_cpu_seconds": run.server_cpu_seconds,
        "server_metrics": server_delta,
        "usage_completion_tokens_all_requests": usage_all,
        "server_generation_tokens_minus_usage_completion_tokens": None
        if server_gen is None
        else server_gen - usage_all,  # > 0: tokens the engine generated that usage did not count
        "server_gauges_during_level": gauge_summary(run.gauge_samples),
        "per_request_ms": [
            {
                "ttft": ms(r["ttft_s"]),
                "latency": ms(r["latency_s"]),
                "tpot": ms(r.get("tpot_s")),
                "tokens": r.get("completion_tokens"),
                "deltas": r.get("content_deltas"),
                **({"error": r["error"]} if r["error"] else {}),
            }
            for r in records
        ],
    }


def describe_workload(args) -> dict:
    """The report's "workload" entry, from serve_load.py's parsed arguments."""
    return {
        "endpoint": "/v1/chat/completions, stream=true, stream_options.include_usage=true",
        "concurrency_levels": args.concurrency,
        "requests_per_level": args.num_requests,
        "clients": "closed loop: C clients, each sends its next request when its previous one ends",
        "prompt": f"{args.prompt_words} random words (seeded, a fresh set per level) as the user message",
        "shared_prefix_words": args.shared_prefix_words,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "sampling_seed": "one per request, drawn from the seeded generator that draws the prompts",
        "seed": args.seed,
        "warmup_requests": args.warmup_requests,
        "ttft": "request sent -> first SSE chunk whose delta carries content, reasoning_content or tool_calls",
        "tbt": "gaps between successive such deltas, pooled over all requests of the level",
        "tpot": "per request: (last output delta - first output delta) / (completion_tokens - 1)",
        "latency": "request sent -> [DONE]",
        "tokens": "usage.completion_tokens of the usage chunk",
        "throughput": "ok requests and their completion tokens / level wall time (first send -> last [DONE])",
        "metrics_interval_s": args.metrics_interval,
    }


def serving_versions() -> dict:
    """_common.versions() plus the HTTP stack's distributions (None where not installed)."""
    out = versions()
    for dist in ("httpx", "fastapi", "uvicorn", "openai", "prometheus-client"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def print_table(levels: list[dict]) -> None:
    def ms(stats: dict, key: str) -> str:
        return "-" if stats[key] is None else f"{stats[key] * 1000:.0f}"

    print()
    print(
        f"{'conc':>4} {'reqs':>5} {'err':>4} {'wall s':>7} {'req/s':>6} {'out tok/s':>9} "
        f"{'TTFT ms p50/p90/p99':>21} {'TBT ms p50/p90/p99':>20} {'latency ms p50/p99':>19} {'KV max':>6}"
    )
    for lv in levels:
        ttft, tbt, lat = lv["ttft_s"], lv["tbt_s"], lv["latency_s"]
        kv = lv["server_gauges_during_level"]["kv_blocks_used_max"]
        print(
            f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['errors']:>4} {lv['wall_seconds']:>7.1f} "
            f"{lv['requests_per_s']:>6.2f} {lv['output_tokens_per_s']:>9.1f} "
            f"{ms(ttft, 'p50') + '/' + ms(ttft, 'p90') + '/' + ms(ttft, 'p99'):>21} "
            f"{ms(tbt, 'p50') + '/' + ms(tbt, 'p90') + '/' + ms(tbt, 'p99'):>20} "
            f"{ms(lat, 'p50') + '/' + ms(lat, 'p99'):>19} {'-' if kv is None else int(kv):>6}"
        )
