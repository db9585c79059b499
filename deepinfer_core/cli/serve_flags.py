"""The flags of `deepinfer serve` (vLLM's names), by group; their defaults are ServeSettings'."""

from __future__ import annotations

import argparse
import json

from deepinfer_core.cli.flags import add_common_flags, add_model_flags, flag_type, human_readable_int
from deepinfer_core.cli.settings import KV_CACHE_DTYPES, UVICORN_LOG_LEVELS, ServeSettings, generation_config, json_list
from deepinfer_core.engine.block_manager import PREFIX_REPLAYS

__all__ = ["add_serve_flags"]

_default = ServeSettings.default  # the flags' defaults are the settings model's


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.9")
    return value


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("engine")
    p.add_argument(
        "--kv-cache-dtype",
        type=str.lower,
        choices=KV_CACHE_DTYPES,
        default=_default("kv_cache_dtype"),
        help="KV cache dtype; auto: the compute dtype",
    )
    p.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=_default("seed"),
        help="seeds the seeds drawn for requests that give none, so runs repeat (default: none: from the "
        "system's randomness)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        type=_fraction,
        default=_default("gpu_memory_utilization"),
        help="share (0, 1] of the device's memory for weights and KV cache; the KV cache gets what the weights "
        "leave (default: none: --kv-cache-memory-bytes decides)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        metavar="BYTES",
        type=human_readable_int,
        default=_default("kv_cache_memory_bytes"),
        help="KV cache size, e.g. 4G or 500m; wins over --gpu-memory-utilization (default: 1 GiB unless "
        "--gpu-memory-utilization is given)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        metavar="GIB",
        type=float,
        default=_default("kv_cache_memory_gb"),
        help="deprecated: --kv-cache-memory-bytes in GiB",
    )
    p.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        metavar="N",
        type=int,
        default=_default("num_kv_blocks"),
        help="number of KV blocks (default: from the KV cache size)",
    )
    p.add_argument(
        "--block-size",
        metavar="N",
        type=int,
        default=_default("block_size"),
        help="tokens per KV block (default: the backend's)",
    )
    p.add_argument(
        "--max-num-seqs", metavar="N", type=int, default=_default("max_num_seqs"), help="requests per engine step"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        type=int,
        default=_default("max_num_batched_tokens"),
        help="tokens per engine step",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_default("enable_prefix_caching"),
        help="reuse the KV cache of prompt prefixes seen before",
    )
    p.add_argument(
        "--prefix-replay",
        type=str.lower,
        choices=PREFIX_REPLAYS,
        default=_default("prefix_replay"),
        help="what a prefix hit recomputes to rebuild DeepSeek-V4/V4.1's sliding windows: exact (every token they "
        "depend on; outputs equal a run without the hit) or bounded (the last 128 tokens, as DeepSeek's engine: "
        "faster, approximate); other models ignore it",
    )
    p.add_argument(
        "--window-snapshot-gb",
        metavar="GIB",
        type=float,
        default=_default("window_snapshot_gb"),
        help="host memory for snapshots of DeepSeek-V4/V4.1's windows at block boundaries: a prefix hit at a "
        "snapshot restores them exactly with nothing replayed (least recently used first out; 0: none)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's output does not depend on the rest of the batch (backends that offer it)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="never replay decode steps from device graphs")
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=_default("speculative_config"),
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}; output as without it (coupled acceptance). '
        "Implemented: method ngram, or mtp (a DeepSeek-V3 or V4 checkpoint's MTP layer drafts), verify fixed, "
        "acceptance coupled; models with paged caches only (DeepSeek V2/V3) (default: off)",
    )


def _server_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("server")
    p.add_argument("--host", default=_default("host"), help="address to listen on; 0.0.0.0 for all interfaces")
    p.add_argument(
        "--port", metavar="PORT", type=int, default=_default("port"), help="port to listen on; 0 for any free port"
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=_default("served_model_name"),
        help="the model name clients send (default: the model's)",
    )
    p.add_argument(
        "--override-generation-config",
        metavar="JSON",
        type=flag_type(generation_config),
        default=_default("override_generation_config"),
        help='JSON defaults for requests, as vLLM: {"max_new_tokens": N} caps the output of chat requests '
        "that give no max_tokens (default: none: up to the end of the context)",
    )
    p.add_argument(
        "--max-waiting-requests",
        metavar="N",
        type=int,
        default=_default("max_waiting_requests"),
        help="sequences that may wait beyond the --max-num-seqs running; more get 503 + Retry-After",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=_default("api_key"),
        help="require this key on /v1 routes (default: $DEEPINFER_API_KEY, else none: open)",
    )
    p.add_argument(
        "--max-request-body-mb",
        metavar="MB",
        type=int,
        default=_default("max_request_body_mb"),
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--shutdown-grace-period",
        metavar="SECONDS",
        type=int,
        default=_default("shutdown_grace_period"),
        help="seconds in-flight requests get on SIGTERM; then each ends with its protocol's error event (503)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        metavar="LEVEL",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        default=_default("uvicorn_log_level"),
        help=f"uvicorn's log level: {', '.join(UVICORN_LOG_LEVELS)}; info logs a line per request",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request from uvicorn"
    )


def _connection_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("connections")
    p.add_argument(
        "--timeout-keep-alive",
        metavar="SECONDS",
        type=float,
        default=_default("timeout_keep_alive"),
        help="an idle keep-alive connection is closed after this long",
    )
    p.add_argument(
        "--timeout-request-header",
        metavar="SECONDS",
        type=float,
        default=_default("timeout_request_header"),
        help="a client must send its whole request line and headers within this long",
    )
    p.add_argument(
        "--timeout-request-body",
        metavar="SECONDS",
        type=float,
        default=_default("timeout_request_body"),
        help="the longest pause allowed between two parts of a request body",
    )
    p.add_argument(
        "--limit-concurrency",
        metavar="N",
        type=int,
        default=_default("limit_concurrency"),
        help="connections open at once; one more is answered 503 and closed (default: none: the open-file limit, "
        "raised to its maximum at start, less 128)",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="JSON",
        type=flag_type(json_list),
        default=_default("allowed_origins"),
        help="origins whose web pages may call the API (CORS), a JSON list such as '[\"https://a.example\"]', "
        '\'["*"]\' for any. Off unless given, unlike vLLM\'s ["*"]: a server without --api-key on a LAN would '
        f"otherwise obey any web page its users visit (default: {json.dumps(_default('allowed_origins'))}: no "
        "CORS headers at all)",
    )
    p.add_argument(
        "--allowed-methods",
        metavar="JSON",
        type=flag_type(json_list),
        default=_default("allowed_methods"),
        help=f"HTTP methods allowed in CORS requests, a JSON list (default: {json.dumps(_default('allowed_methods'))})",
    )
    p.add_argument(
        "--allowed-headers",
        metavar="JSON",
        type=flag_type(json_list),
        default=_default("allowed_headers"),
        help=f"HTTP headers allowed in CORS requests, a JSON list (default: {json.dumps(_default('allowed_headers'))})",
    )
    p.add_argument(
        "--allow-credentials", action="store_true", help="allow cookies and Authorization headers in CORS requests"
    )


def _parallel_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("several ranks")
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        metavar="N",
        type=int,
        default=_default("data_parallel_size"),
        help="engine ranks, one process per device: each runs attention for its own requests; requests go to the "
        "rank with the fewest, then the least KV",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="the ranks split the routed experts (one expert-parallel world of --data-parallel-size ranks)",
    )
    p.add_argument(
        "--enable-eplb",
        action="store_true",
        help="re-place the experts, with redundant copies, between the ranks from their recent loads while serving",
    )
    p.add_argument(
        "--eplb-config",
        metavar="JSON",
        default=_default("eplb_config"),
        help='EPLB\'s settings, vLLM\'s JSON: {"window_size": 1000, "step_interval": 10000, '
        '"num_redundant_experts": N}, and "phase": "decode" or "prefill" for DeepSeek\'s settings of that phase '
        "in the keys not given (default: decode: a window of 1000 steps, every 10000 steps, one redundant expert "
        "per rank; prefill: 100 steps, every 1000, four per rank)",
    )


def _node_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("several nodes (vLLM's flags)")
    p.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        metavar="N",
        type=int,
        default=_default("data_parallel_size_local"),
        help="ranks on this node, the others on nodes running --headless (default: all of them here)",
    )
    p.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        metavar="K",
        type=int,
        default=_default("data_parallel_start_rank"),
        help="with --headless: the first rank this node runs",
    )
    p.add_argument(
        "--data-parallel-address",
        "-dpa",
        metavar="HOST",
        default=_default("data_parallel_address"),
        help="the head node's address, where the ranks' queues are served and torch.distributed meets",
    )
    p.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        metavar="PORT",
        type=int,
        default=_default("data_parallel_rpc_port"),
        help="the head's port for the ranks' queues (torch.distributed's rendezvous takes the next one); set "
        "$DEEPINFER_DATA_PARALLEL_KEY to the same secret on every node",
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="run this node's ranks of a head's world and no API server (the engine's settings come from the head)",
    )


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    _engine_flags(parser)
    _parallel_flags(parser)
    _node_flags(parser)
    _server_flags(parser)
    _connection_flags(parser)
    add_common_flags(parser)
