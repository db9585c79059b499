"""`deepinfer serve`: the OpenAI- and Anthropic-compatible HTTP server (vLLM's flag names). Its settings
(flags, --config file, $DEEPINFER_*) are validated as one ServeSettings before the port is bound."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from deepinfer_core.backend.selection import accelerator_source, requested_accelerator
from deepinfer_core.cli.flags import HelpFormatter, add_common_flags, add_model_flags, flag_type, human_readable_int
from deepinfer_core.cli.settings import (
    KV_CACHE_DTYPES,
    UVICORN_LOG_LEVELS,
    ServeSettings,
    from_command_line,
    generation_config,
    json_list,
)
from deepinfer_core.engine.block_manager import PREFIX_REPLAYS
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser", "build_state", "serve_settings"]

log = logging.getLogger("deepinfer.serve")
_default = ServeSettings.default  # the flags' defaults are the settings model's


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.9")
    return value


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The validated settings of this run (see settings.from_command_line); a DeepInferError naming each wrong
    value as its user spelled it."""
    return from_command_line(_add_flags, args.command_line, args.config_file, args.model)


def build_state(settings: ServeSettings):
    """The server's state: the model loaded as `settings` say, its engine, tokenizer and limits."""
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.serve.async_engine import AsyncEngine
    from deepinfer_core.serve.metrics import ServerMetrics
    from deepinfer_core.serve.state import ServerState, build_recipe

    # from the environment, left to backend selection, whose messages then name $DEEPINFER_ACCELERATOR
    accelerator = settings.accelerator if settings.origin("accelerator").kind in ("flag", "config") else None
    llm = LLM(
        model=settings.model,
        tokenizer=settings.tokenizer,
        revision=settings.revision,
        download_dir=settings.download_dir,
        accelerator=accelerator,
        dtype=settings.dtype,
        seed=settings.seed,
        kv_cache_dtype=settings.kv_cache_dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        max_model_len=settings.max_model_len,
        engram_placement=settings.engram_placement,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        prefix_replay=settings.prefix_replay,
        window_snapshot_gb=settings.window_snapshot_gb,
        batch_invariant=settings.batch_invariant,
        graph_batch_size=0 if settings.enforce_eager else 256,
        progress=sys.stderr.isatty(),
    )
    if llm.tokenizer is None:
        raise DeepInferError(
            f"{llm.model_name} has no tokenizer.json; the server needs one to encode conversations: pass --tokenizer"
        )
    name = settings.served_model_name or llm.model_name
    recipe_tokenizer, encoding, options = build_recipe(str(llm.tokenizer_dir / "tokenizer.json"), name)
    backend = llm.backend
    asked = requested_accelerator(accelerator)
    log.info(
        "backend %s selected (%s %s): %s on %s",
        backend.info.name,
        asked,
        "from " + accelerator_source(accelerator) if asked != "auto" else "by priority",
        backend.info.description,
        backend.device.name,
    )
    log.info(
        "serving %s as %r, context %d tokens, %d KV blocks of %d tokens, prefix caching %s",
        llm.model_name,
        name,
        llm.engine.max_model_len,
        llm.engine.blocks.num_blocks,
        llm.engine.blocks.block_size,
        "on" if llm.engine.blocks.enable_prefix_caching else "off",
    )
    return ServerState(
        engine=AsyncEngine(llm.engine, max_waiting=settings.max_waiting_requests),
        served_model_name=name,
        tokenizer=llm.tokenizer,
        recipe_tokenizer=recipe_tokenizer,
        encoding=encoding,
        options=options,
        max_model_len=llm.engine.max_model_len,
        eos_token_ids=llm.engine.eos_token_ids,
        metrics=ServerMetrics(),
        api_key=settings.api_key,
        max_body_bytes=settings.max_request_body_mb << 20,
        default_max_tokens=(settings.override_generation_config or {}).get("max_new_tokens"),
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer_core.cli.listen import ListeningServer, bind, default_connection_limit, url
    from deepinfer_core.serve.app import CorsPolicy, build_app
    from deepinfer_core.serve.http_protocol import HttpLimits, guarded_protocol

    settings = serve_settings(args)  # before binding and loading: a wrong value fails at once
    fitting = default_connection_limit()  # raises the open-file limit to its maximum first
    with bind(settings.host, settings.port) as sock:  # before loading: a busy port fails now, not after the load
        state = build_state(settings)
        limits = HttpLimits(
            header_timeout=settings.timeout_request_header,
            body_timeout=settings.timeout_request_body,
            max_connections=settings.limit_concurrency or fitting,
        )
        cors = CorsPolicy(
            tuple(settings.allowed_origins),
            tuple(settings.allowed_methods),
            tuple(settings.allowed_headers),
            settings.allow_credentials,
        )
        config = uvicorn.Config(
            build_app(state, cors),
            host=settings.host,
            port=sock.getsockname()[1],
            http=guarded_protocol(limits),
            log_level=settings.uvicorn_log_level,
            access_log=not settings.disable_uvicorn_access_log,
            timeout_keep_alive=settings.timeout_keep_alive,
        )
        access = "needs an API key" if state.api_key else "open"
        server = ListeningServer(
            config,
            lambda: log.info(
                "listening on %s (access %s, at most %d connections)", url(sock), access, limits.max_connections
            ),
            grace_period=settings.shutdown_grace_period,
            on_grace_expired=lambda: state.engine.end_all("shutdown grace period expired"),
        )
        # uvicorn answers SIGTERM with a graceful shutdown, then raises it again for the handler that was in
        # place before: with the default one, a clean stop would end in death by signal (status 143), not 0
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    log.info("server stopped")
    return 0


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


def _add_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    _engine_flags(parser)
    _server_flags(parser)
    _connection_flags(parser)
    add_common_flags(parser)


def add_parser(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve a model over OpenAI- and Anthropic-compatible HTTP APIs, with vLLM's flags.\n"
        "With no MODEL, the embedded demo model (random weights).\n"
        "Each flag may also be set as $DEEPINFER_<FLAG> (DEEPINFER_MAX_NUM_SEQS=32, DEEPINFER_API_KEY=...); the\n"
        "command line wins over --config, which wins over the environment.",
        formatter_class=HelpFormatter,
    )
    _add_flags(p)
    p.set_defaults(run=_cmd_serve)
