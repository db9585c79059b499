"""`deepinfer serve`: the OpenAI- and Anthropic-compatible HTTP server (vLLM's flag names). Its settings
(flags, --config file, $DEEPINFER_*) are validated as one ServeSettings before the port is bound."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from deepinfer_core.backend.selection import accelerator_source, requested_accelerator
from deepinfer_core.cli.flags import HelpFormatter
from deepinfer_core.cli.serve_flags import add_serve_flags
from deepinfer_core.cli.settings import ServeSettings, from_command_line
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser", "build_state", "serve_settings"]

log = logging.getLogger("deepinfer.serve")


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The validated settings of this run (see settings.from_command_line); a DeepInferError naming each wrong
    value as its user spelled it."""
    return from_command_line(add_serve_flags, args.command_line, args.config_file, args.model)


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
        speculative_config=settings.speculative_config,
        data_parallel_size=settings.data_parallel_size,
        enable_expert_parallel=settings.enable_expert_parallel,
        enable_eplb=settings.enable_eplb,
        eplb_config=None if settings.eplb_config is None else json.loads(settings.eplb_config),
        data_parallel_size_local=settings.data_parallel_size_local,
        data_parallel_address=settings.data_parallel_address,
        data_parallel_rpc_port=settings.data_parallel_rpc_port,
        progress=sys.stderr.isatty(),
    )
    if llm.tokenizer is None:
        raise DeepInferError(
            f"{llm.model_name} has no tokenizer.json; the server needs one to encode conversations: pass --tokenizer"
        )
    name = settings.served_model_name or llm.model_name
    recipe_tokenizer, encoding, options = build_recipe(str(llm.tokenizer_dir / "tokenizer.json"), name)
    if llm.backend is not None:
        backend = (llm.backend.info.name, llm.backend.info.description, llm.backend.device.name)
    else:  # several ranks: each has its own; rank 0's named
        info = llm.engine.rank_info[0]
        backend = (info["backend"], info["backend_description"], f"{info['device']} x {llm.engine.size} ranks")
    asked = requested_accelerator(accelerator)
    how = "from " + accelerator_source(accelerator) if asked != "auto" else "by priority"
    log.info("backend %s selected (%s %s): %s on %s", backend[0], asked, how, *backend[1:])
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
    if settings.headless:  # another node's ranks: no API server
        from deepinfer_core.parallel.nodes import serve_headless

        return serve_headless(
            settings.data_parallel_address, settings.data_parallel_rpc_port, settings.data_parallel_size,
            settings.data_parallel_start_rank, settings.data_parallel_size_local,
        )  # fmt: skip
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
    add_serve_flags(p)
    p.set_defaults(run=_cmd_serve)
