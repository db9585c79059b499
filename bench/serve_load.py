"""Serving under load: a concurrency sweep of streaming chat completions against `deepinfer serve`.

One run (DESIGN.md §7: numbers go to JSON naming the machine; nothing here asserts a time):

1. starts `deepinfer serve` as a subprocess on a free local port (the embedded demo model unless
   `--server-arg --model --server-arg DIR`), or targets `--url` of a server that is already running;
   waits for /health and reads the served model name from /v1/models;
2. warms up with a few requests, then for each concurrency level C (default 1, 4, 16, 64) runs a fixed
   number of streaming `/v1/chat/completions` requests through C closed-loop clients (each sends its next
   request when the previous one ends), all with `stream_options.include_usage`;
3. the prompts are seeded random English words (a fresh set per level, so the prefix cache sees no
   repeats unless `--shared-prefix-words` gives every prompt the same system message), a fixed number of
   words each, a fixed `max_tokens`, temperature 1 with a seeded `seed` per request (greedy decoding of
   the random-weight demo model repeats the prompt's last token, `</think>`, which the chat parser
   swallows: every answer would be empty);
4. per request: time to first token (first delta carrying output: content, reasoning_content or
   tool_calls), time between tokens (gaps between successive such deltas), end-to-end latency, tokens
   received (the usage chunk's completion_tokens, compared with the server's generation-token counter);
   per level: requests/s, output tokens/s, TTFT / TBT / TPOT / latency p50, p90, p99, errors;
5. /metrics is scraped before and after every level (and sampled while it runs, for KV blocks in use
   and requests running/waiting), so the server's own counters, histograms and prefix cache hit rate
   sit next to what the clients measured;
6. writes JSON (machine, versions, server command and flags, workload, per-level results, timestamp),
   prints a table, and stops the server it started.

Run: python bench/serve_load.py --out bench/results/serve_load_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import machine, median, versions  # noqa: E402
from _serving import (  # noqa: E402
    LocalServer,
    gauge_summary,
    metrics_delta,
    sample_metrics,
    scrape,
    wait_healthy,
)

# ---- workload -------------------------------------------------------------------------------------

# Common English words: nearly all are one token (with their leading space) in BPE vocabularies, so
# N words make a user message of about N tokens. The exact prompt length comes back in each usage chunk.
WORDS = """
the of and to in is was for on that with as by at from his it an were are which this be or has had
not but one their after first new two its who they have been also her other all more time most can
year only over into some would than later three such during these years may then when him where well
used part team many made him world city season both state known back however school while about
under game river before between four around film called people through since number high series
group name north south east west music album family early five life each being band house three
war area end found became member long take work play day line point water place light stone green
""".split()
WORDS = list(dict.fromkeys(WORDS))  # each word once


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def level_prompts(seed: int, level_index: int, count: int, words: int) -> list[tuple[str, int]]:
    """(user message, sampling seed) per request; str seeds are stable across processes."""
    rng = random.Random(f"serve_load/{seed}/{level_index}")
    return [(make_prompt(rng, words), rng.randrange(1 << 31)) for _ in range(count)]


def shared_prefix(seed: int, words: int) -> str | None:
    return make_prompt(random.Random(f"serve_load/{seed}/prefix"), words) if words else None


# ---- statistics -----------------------------------------------------------------------------------


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


# ---- clients --------------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """One streaming chat completion, timed from just before the request is sent."""
    record = {"ok": False, "error": None, "status": None, "ttft_s": None, "latency_s": None, "gaps_s": []}
    deltas, usage, finish, done, last_content, kinds = 0, None, None, False, None, Counter()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record["error"] = f"HTTP {response.status_code}: {text[:200]}"
                record["latency_s"] = time.perf_counter() - t0
                return record
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    carried = [k for k in ("content", "reasoning_content", "tool_calls") if delta.get(k)]
                    for kind in carried:
                        kinds[kind] += 1
                    if carried:
                        if last_content is None:
                            record["ttft_s"] = now - t0
                        else:
                            record["gaps_s"].append(now - last_content)
                        last_content = now
                        deltas += 1
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:200]
        record["latency_s"] = time.perf_counter() - t0
        return record
    record["latency_s"] = time.perf_counter() - t0
    record["content_deltas"] = deltas
    record["delta_kinds"] = dict(kinds)
    record["finish_reason"] = finish
    if usage:
        record["completion_tokens"] = usage.get("completion_tokens")
        record["prompt_tokens"] = usage.get("prompt_tokens")
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if not done:
        record["error"] = "stream ended without [DONE]"
    elif usage is None:
        record["error"] = "no usage in the stream (stream_options.include_usage was sent)"
    elif record["ttft_s"] is None:
        record["error"] = "no output delta (content, reasoning_content or tool_calls)"
    else:
        record["ok"] = True
        tokens = record["completion_tokens"] or 0
        if tokens > 1:  # per-request time per output token after the first
            record["tpot_s"] = (last_content - t0 - record["ttft_s"]) / (tokens - 1)
    return record


def request_body(model: str, prompt: tuple[str, int], prefix: str | None, args) -> dict:
    prompt, seed = prompt
    messages = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": prompt}]
    return {
        "model": model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    concurrency: int,
    prompts: list[tuple[str, int]],
    prefix: str | None,
    args,
    headers: dict,
    server: LocalServer | None,
) -> dict:
    before = await scrape(client, url)
    stop, samples = asyncio.Event(), []
    sampler = asyncio.create_task(sample_metrics(client, url, args.metrics_interval, samples, stop))
    pending = list(enumerate(prompts))[::-1]
    records: list[dict | None] = [None] * len(prompts)

    async def worker() -> None:
        while pending:
            index, prompt = pending.pop()
            records[index] = await one_request(client, url, request_body(model, prompt, prefix, args), headers)

    server_cpu0, client_cpu0 = (server.cpu_seconds() if server else None), time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    server_cpu1, client_cpu1 = (server.cpu_seconds() if server else None), time.process_time()
    stop.set()
    await sampler
    after = await scrape(client, url)

    ok = [r for r in records if r["ok"]]
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    server_delta = metrics_delta(before, after)
    usage_all = sum(r.get("completion_tokens") or 0 for r in records)
    server_gen = server_delta["generation_tokens"] if server_delta else None
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    return {
        "concurrency": concurrency,
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
            1 for r in ok if r.get("finish_reason") == "length" and (r["completion_tokens"] or 0) < args.max_tokens
        ),
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in ok)),
        "prefix_cached_tokens": cached,
        "prefix_cached_fraction_of_prompt_tokens": cached / sum(prompt_tokens) if prompt_tokens else None,
        "ttft_s": summary([r["ttft_s"] for r in ok]),
        "tbt_s": summary([g for r in ok for g in r["gaps_s"]]),
        "tpot_s": summary([r["tpot_s"] for r in ok if "tpot_s" in r]),
        "latency_s": summary([r["latency_s"] for r in ok]),
        "client_cpu_seconds": client_cpu1 - client_cpu0,
        "server_cpu_seconds": None if server_cpu0 is None or server_cpu1 is None else server_cpu1 - server_cpu0,
        "server_metrics": server_delta,
        "usage_completion_tokens_all_requests": usage_all,
        "server_generation_tokens_minus_usage_completion_tokens": None
        if server_gen is None
        else server_gen - usage_all,  # > 0: tokens the engine generated that usage did not count
        "server_gauges_during_level": gauge_summary(samples),
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


# ---- report ---------------------------------------------------------------------------------------


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


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.replace(" ", "").split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def all_versions() -> dict:
    out = versions()
    for dist in ("httpx", "fastapi", "uvicorn", "openai", "prometheus-client"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


async def sweep(args, url: str, server: LocalServer | None, report: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connections = max(args.concurrency) + 8  # the clients plus the /metrics sampler
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        report["server"]["health_wait_seconds"] = await wait_healthy(client, url, server, args.startup_timeout)
        models = (await client.get(url + "/v1/models", headers=headers)).json()
        model = args.model or models["data"][0]["id"]
        report["server"]["model_card"] = models["data"][0]
        report["server"]["metrics_at_start"] = await scrape(client, url)
        prefix = shared_prefix(args.seed, args.shared_prefix_words)
        warm = level_prompts(args.seed, -1, args.warmup_requests, args.prompt_words)
        t0 = time.perf_counter()
        warm_records = [await one_request(client, url, request_body(model, p, prefix, args), headers) for p in warm]
        report["warmup"] = {
            "requests": len(warm),
            "seconds": time.perf_counter() - t0,
            "errors": [r["error"] for r in warm_records if r["error"]],
        }
        print(f"serving {model!r} at {url}; warm-up {report['warmup']['seconds']:.1f} s", flush=True)
        levels = []
        for index, (concurrency, count) in enumerate(zip(args.concurrency, args.num_requests)):
            prompts = level_prompts(args.seed, index, count, args.prompt_words)
            level = await run_level(client, url, model, concurrency, prompts, prefix, args, headers, server)
            levels.append(level)
            print(
                f"concurrency {concurrency}: {level['ok']}/{count} ok in {level['wall_seconds']:.1f} s, "
                f"{level['output_tokens_per_s']:.1f} out tok/s",
                flush=True,
            )
        report["server"]["metrics_at_end"] = await scrape(client, url)
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_load_cpu.json"))
    parser.add_argument("--url", help="target this running server (e.g. http://127.0.0.1:8000) instead of starting one")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64], help="levels, comma-separated")
    parser.add_argument(
        "--num-requests",
        type=int_list,
        default=[8, 16, 32, 64],
        help="requests per level: one number for every level, or one per level",
    )
    parser.add_argument("--prompt-words", type=int, default=64, help="random words in each user message")
    parser.add_argument("--shared-prefix-words", type=int, default=0, help="same system message on every request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="1 by default: greedy output of the demo model is empty (above)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `deepinfer serve` argument, repeatable (e.g. --server-arg=--max-num-seqs --server-arg=32)",
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS / MKL_NUM_THREADS for the started server; 0 keeps torch's default (one per core). "
        "1 by default: the load-generating client shares the machine (bench/README.md)",
    )
    parser.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--stop-grace", type=float, default=90.0, help="seconds after SIGTERM before SIGKILL")
    args = parser.parse_args(argv)
    if len(args.num_requests) == 1:
        args.num_requests = args.num_requests * len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        parser.error("--num-requests needs one number, or one per --concurrency level")

    started = time.perf_counter()
    load_before = os.getloadavg()
    report: dict = {
        "benchmark": "serve_load",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/serve_load.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    with tempfile.TemporaryDirectory(prefix="deepinfer-serve-load-") as tmp:
        server = None
        if args.url:
            url = args.url.rstrip("/")
            report["server"] = {"started_by_benchmark": False, "url": url, "flags": "unknown (a running server)"}
        else:
            server = LocalServer(args.server_arg, args.server_threads, Path(tmp))
            url = server.url
            report["server"] = {
                "started_by_benchmark": True,
                "url": url,
                "command": server.command,
                "flags": args.server_arg,
                "flags_note": "every other `deepinfer serve` flag at its default (deepinfer_core/cli/serve.py)",
                "env": {"OMP_NUM_THREADS": str(args.server_threads), "MKL_NUM_THREADS": str(args.server_threads)}
                if args.server_threads
                else {},
            }
            server.start()
            print(f"started: {server.command} (pid {server.proc.pid})", flush=True)
        try:
            levels = asyncio.run(sweep(args, url, server, report))
        finally:
            if server is not None:
                report["server"]["stop"] = server.stop(args.stop_grace)
                lines = server.log_lines()
                report["server"]["log"] = lines[:200]
                report["server"]["log_tracebacks"] = sum(1 for line in lines if line.startswith("Traceback"))

    prefix_words = args.shared_prefix_words
    report.update(
        {
            "machine": {
                **machine(),
                "load_average_1_5_15_before": load_before,
                "load_average_1_5_15_after": os.getloadavg(),
                "note": "client and server share this machine" if server else "client machine; the server is elsewhere",
            },
            "versions": all_versions(),
            "workload": {
                "endpoint": "/v1/chat/completions, stream=true, stream_options.include_usage=true",
                "concurrency_levels": args.concurrency,
                "requests_per_level": args.num_requests,
                "clients": "closed loop: C clients, each sends its next request when its previous one ends",
                "prompt": f"{args.prompt_words} random words (seeded, a fresh set per level) as the user message",
                "shared_prefix_words": prefix_words,
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
            },
            "levels": levels,
            "wall_seconds": time.perf_counter() - started,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(levels)
    if server is not None and report["server"].get("log_tracebacks"):
        print(f"note: {report['server']['log_tracebacks']} traceback(s) in the server log (server.log in the JSON)")
    print(f"\nwrote {args.out} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
