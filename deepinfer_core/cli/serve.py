"""`deepinfer serve`: the OpenAI- and Anthropic-compatible HTTP server (vLLM's flag names)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from deepinfer_core.backend.selection import ENV_VAR
from deepinfer_core.errors import DeepInferError

__all__ = ["add_parser"]

log = logging.getLogger("deepinfer.serve")


def build_state(args: argparse.Namespace):
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.serve.async_engine import AsyncEngine
    from deepinfer_core.serve.metrics import ServerMetrics
    from deepinfer_core.serve.state import ServerState, build_recipe

    llm = LLM(
        model=args.model,
        accelerator=args.accelerator,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gb * (1 << 30)),
        enable_prefix_caching=not args.no_enable_prefix_caching,
        batch_invariant=args.batch_invariant,
        graph_batch_size=0 if args.enforce_eager else 256,
        progress=sys.stderr.isatty(),
    )
    if llm.tokenizer is None:
        raise DeepInferError(f"{args.model} has no tokenizer.json; the server needs one to encode conversations")
    name = args.served_model_name or llm.model_name
    recipe_tokenizer, encoding, options = build_recipe(str(llm.tokenizer_dir / "tokenizer.json"), name)
    backend = llm.backend
    log.info(
        "backend %s selected (%s=%s): %s on %s",
        backend.info.name,
        ENV_VAR,
        args.accelerator or os.environ.get(ENV_VAR, "auto"),
        backend.info.description,
        backend.device.name,
    )
    log.info(
        "serving %s as %r, context %d tokens, %d KV blocks of %d tokens",
        llm.model_name,
        name,
        llm.engine.max_model_len,
        llm.engine.blocks.num_blocks,
        llm.engine.blocks.block_size,
    )
    api_key = args.api_key or os.environ.get("DEEPINFER_API_KEY") or None
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
        api_key=api_key,
        max_body_bytes=args.max_request_body_mb << 20,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer_core.serve.app import build_app

    state = build_state(args)
    log.info(
        "listening on http://%s:%d (access %s)", args.host, args.port, "needs an API key" if state.api_key else "open"
    )
    # uvicorn answers SIGTERM with a graceful shutdown, then raises it again for the handler that was in
    # place before: with the default one, a clean stop would end in death by signal (status 143), not 0
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=args.shutdown_grace_period,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("server stopped")
    return 0


def add_parser(commands) -> None:
    p = commands.add_parser("serve", help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--accelerator", default=None, help=f"backend name, alias or 'auto' (default: ${ENV_VAR} or auto)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the folder name)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the backend's)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's output does not depend on the rest of the batch (backends that offer it)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="never replay decode steps from device graphs")
    p.add_argument("--max-waiting-requests", type=int, default=512, help="beyond this, answer 503 + Retry-After")
    p.add_argument("--api-key", default=None, help="require this key on /v1 routes (default: $DEEPINFER_API_KEY)")
    p.add_argument("--max-request-body-mb", type=int, default=8)
    p.add_argument("--shutdown-grace-period", type=int, default=60, help="seconds in-flight requests get on SIGTERM")
    p.set_defaults(run=_cmd_serve)
