"""`deepinfer serve`: the OpenAI- and Anthropic-compatible HTTP server (vLLM's flag names)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from deepinfer_core.backend.selection import accelerator_source, requested_accelerator
from deepinfer_core.cli.flags import HelpFormatter, add_common_flags, add_model_flags, human_readable_int
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser", "build_state"]

log = logging.getLogger("deepinfer.serve")

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's --uvicorn-log-level
# vLLM's generation-config keys that set defaults for the sampling fields a request leaves out
_LATER_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config(text: str) -> dict:
    """--override-generation-config: a JSON object; max_new_tokens (vLLM's key) is the default max_tokens of
    requests that give none."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err}); e.g. '{{\"max_new_tokens\": 256}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object such as {{"max_new_tokens": 256}}, got {text!r}')
    for key, item in value.items():
        if key in _LATER_GENERATION_KEYS:
            raise argparse.ArgumentTypeError(
                f"{key} is not supported yet (only max_new_tokens); clients set {key} in each request"
            )
        if key != "max_new_tokens":
            raise argparse.ArgumentTypeError(f"unknown key {key!r}; the supported key is max_new_tokens")
        if not isinstance(item, int) or isinstance(item, bool) or item < 1:
            raise argparse.ArgumentTypeError(f"max_new_tokens must be a positive integer, got {item!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.9")
    return value


def _kv_cache_memory_bytes(args: argparse.Namespace) -> int | None:
    if args.kv_cache_memory_gb is None:
        return args.kv_cache_memory_bytes
    if args.kv_cache_memory_bytes is not None:
        raise DeepInferError("give --kv-cache-memory-bytes or --kv-cache-memory-gb, not both")
    return int(args.kv_cache_memory_gb * (1 << 30))


def build_state(args: argparse.Namespace):
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.serve.async_engine import AsyncEngine
    from deepinfer_core.serve.metrics import ServerMetrics
    from deepinfer_core.serve.state import ServerState, build_recipe

    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        revision=args.revision,
        download_dir=args.download_dir,
        accelerator=args.accelerator,
        dtype=args.dtype,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=_kv_cache_memory_bytes(args),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        batch_invariant=args.batch_invariant,
        graph_batch_size=0 if args.enforce_eager else 256,
        progress=sys.stderr.isatty(),
    )
    if llm.tokenizer is None:
        raise DeepInferError(
            f"{llm.model_name} has no tokenizer.json; the server needs one to encode conversations: pass --tokenizer"
        )
    name = args.served_model_name or llm.model_name
    recipe_tokenizer, encoding, options = build_recipe(str(llm.tokenizer_dir / "tokenizer.json"), name)
    backend = llm.backend
    asked = requested_accelerator(args.accelerator)
    log.info(
        "backend %s selected (%s %s): %s on %s",
        backend.info.name,
        asked,
        "from " + accelerator_source(args.accelerator) if asked != "auto" else "by priority",
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
        engine=AsyncEngine(llm.engine, max_waiting=args.max_waiting_requests),
        served_model_name=name,
        tokenizer=llm.tokenizer,
        recipe_tokenizer=recipe_tokenizer,
        encoding=encoding,
        options=options,
        max_model_len=llm.engine.max_model_len,
        eos_token_ids=llm.engine.eos_token_ids,
        metrics=ServerMetrics(),
        api_key=args.api_key or os.environ.get("DEEPINFER_API_KEY") or None,
        max_body_bytes=args.max_request_body_mb << 20,
        default_max_tokens=(args.override_generation_config or {}).get("max_new_tokens"),
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer_core.cli.listen import ListeningServer, bind, url
    from deepinfer_core.serve.app import build_app

    with bind(args.host, args.port) as sock:  # before loading: a busy port fails now, not after the load
        state = build_state(args)
        config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=sock.getsockname()[1],
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=args.shutdown_grace_period,
        )
        access = "needs an API key" if state.api_key else "open"
        server = ListeningServer(config, lambda: log.info("listening on %s (access %s)", url(sock), access))
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
        default="auto",
        help="KV cache dtype; auto: the compute dtype",
    )
    p.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=None,
        help="seeds the seeds drawn for requests that give none, so runs repeat (default: none: from the "
        "system's randomness)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        type=_fraction,
        default=None,
        help="share (0, 1] of the device's memory for weights and KV cache; the KV cache gets what the weights "
        "leave (default: none: --kv-cache-memory-bytes decides)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        metavar="BYTES",
        type=human_readable_int,
        default=None,
        help="KV cache size, e.g. 4G or 500m; wins over --gpu-memory-utilization (default: 1 GiB unless "
        "--gpu-memory-utilization is given)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        metavar="GIB",
        type=float,
        default=None,
        help="deprecated: --kv-cache-memory-bytes in GiB",
    )
    p.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        metavar="N",
        type=int,
        default=None,
        help="number of KV blocks (default: from the KV cache size)",
    )
    p.add_argument(
        "--block-size", metavar="N", type=int, default=None, help="tokens per KV block (default: the backend's)"
    )
    p.add_argument("--max-num-seqs", metavar="N", type=int, default=64, help="requests per engine step")
    p.add_argument("--max-num-batched-tokens", metavar="N", type=int, default=2048, help="tokens per engine step")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of prompt prefixes seen before",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's output does not depend on the rest of the batch (backends that offer it)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="never replay decode steps from device graphs")


def _server_flags(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("server")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all interfaces")
    p.add_argument("--port", metavar="PORT", type=int, default=8000, help="port to listen on; 0 for any free port")
    p.add_argument(
        "--served-model-name", metavar="NAME", default=None, help="the model name clients send (default: the model's)"
    )
    p.add_argument(
        "--override-generation-config",
        metavar="JSON",
        type=generation_config,
        default=None,
        help='JSON defaults for requests, as vLLM: {"max_new_tokens": N} caps the output of chat requests '
        "that give no max_tokens (default: none: up to the end of the context)",
    )
    p.add_argument(
        "--max-waiting-requests", metavar="N", type=int, default=512, help="beyond this, answer 503 + Retry-After"
    )
    p.add_argument(
        "--api-key", metavar="KEY", default=None, help="require this key on /v1 routes (default: $DEEPINFER_API_KEY)"
    )
    p.add_argument("--max-request-body-mb", metavar="MB", type=int, default=8, help="larger request bodies get 413")
    p.add_argument(
        "--shutdown-grace-period",
        metavar="SECONDS",
        type=int,
        default=60,
        help="seconds in-flight requests get on SIGTERM",
    )
    p.add_argument(
        "--uvicorn-log-level",
        metavar="LEVEL",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        default="info",
        help=f"uvicorn's log level: {', '.join(UVICORN_LOG_LEVELS)}; info logs a line per request",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request from uvicorn"
    )


def add_parser(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve a model over OpenAI- and Anthropic-compatible HTTP APIs, with vLLM's flags.\n"
        "With no MODEL, the embedded demo model (random weights).",
        formatter_class=HelpFormatter,
    )
    add_model_flags(p)
    _engine_flags(p)
    _server_flags(p)
    add_common_flags(p)
    p.set_defaults(run=_cmd_serve)
