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
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: bench/ holds its helpers
from _common import machine  # noqa: E402
from _serve_client import level_prompts, one_request, request_body, shared_prefix  # noqa: E402
from _serve_report import LevelRun, describe_workload, level_result, print_table, serving_versions  # noqa: E402
from _serving import LocalServer, sample_metrics, scrape, wait_healthy  # noqa: E402


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    concurrency: int,
    prompts: list[tuple[str, int]],
    make_body: Callable[[tuple[str, int]], dict],
    args,
    headers: dict,
    server: LocalServer | None,
) -> dict:
    """Send `prompts` through `concurrency` closed-loop clients, with /metrics scraped around and sampled during."""
    before = await scrape(client, url)
    stop, samples = asyncio.Event(), []
    sampler = asyncio.create_task(sample_metrics(client, url, args.metrics_interval, samples, stop))
    pending = list(enumerate(prompts))[::-1]
    records: list[dict | None] = [None] * len(prompts)

    async def worker() -> None:
        while pending:
            index, prompt = pending.pop()
            records[index] = await one_request(client, url, make_body(prompt), headers)

    server_cpu0, client_cpu0 = (server.cpu_seconds() if server else None), time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    server_cpu1, client_cpu1 = (server.cpu_seconds() if server else None), time.process_time()
    stop.set()
    await sampler
    after = await scrape(client, url)
    run = LevelRun(
        concurrency=concurrency,
        records=records,
        wall_seconds=wall,
        client_cpu_seconds=client_cpu1 - client_cpu0,
        server_cpu_seconds=None if server_cpu0 is None or server_cpu1 is None else server_cpu1 - server_cpu0,
        metrics_before=before,
        metrics_after=after,
        gauge_samples=samples,
    )
    return level_result(run, args.max_tokens)


async def sweep(args, url: str, server: LocalServer | None, report: dict) -> list[dict]:
    """Wait for the server, warm it up, then run every concurrency level; server facts go into `report`."""
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
        make_body = partial(
            request_body, model, prefix=prefix, max_tokens=args.max_tokens, temperature=args.temperature
        )
        warm = level_prompts(args.seed, -1, args.warmup_requests, args.prompt_words)
        t0 = time.perf_counter()
        warm_records = [await one_request(client, url, make_body(p), headers) for p in warm]
        report["warmup"] = {
            "requests": len(warm),
            "seconds": time.perf_counter() - t0,
            "errors": [r["error"] for r in warm_records if r["error"]],
        }
        print(f"serving {model!r} at {url}; warm-up {report['warmup']['seconds']:.1f} s", flush=True)
        levels = []
        for index, (concurrency, count) in enumerate(zip(args.concurrency, args.num_requests)):
            prompts = level_prompts(args.seed, index, count, args.prompt_words)
            level = await run_level(client, url, concurrency, prompts, make_body, args, headers, server)
            levels.append(level)
            print(
                f"concurrency {concurrency}: {level['ok']}/{count} ok in {level['wall_seconds']:.1f} s, "
                f"{level['output_tokens_per_s']:.1f} out tok/s",
                flush=True,
            )
        report["server"]["metrics_at_end"] = await scrape(client, url)
    return levels


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.replace(" ", "").split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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

    report.update(
        {
            "machine": {
                **machine(),
                "load_average_1_5_15_before": load_before,
                "load_average_1_5_15_after": os.getloadavg(),
                "note": "client and server share this machine" if server else "client machine; the server is elsewhere",
            },
            "versions": serving_versions(),
            "workload": describe_workload(args),
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
