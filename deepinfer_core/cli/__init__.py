"""The `deepinfer` command line. Errors meant for people are printed as one message, never a traceback."""

from __future__ import annotations

import argparse
import sys

from deepinfer_core import __version__
from deepinfer_core.backend.hookspecs import API_VERSION
from deepinfer_core.cli import backends, conformance, generate, serve
from deepinfer_core.cli.config_file import expand_config, underscores_to_dashes
from deepinfer_core.cli.flags import resolve_model
from deepinfer_core.cli.logging_setup import configure_logging, resolve_level
from deepinfer_core.errors import DeepInferError

__all__ = ["main"]


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's parser by name."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="Serve DeepSeek MoE models on any accelerator.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__} (contract v{API_VERSION})")
    commands = parser.add_subparsers(dest="command", required=True)
    backends.add_parser(commands)
    generate.add_parser(commands)
    conformance.add_parser(commands)
    serve.add_parser(commands)
    return parser, dict(commands.choices)


def _environment_error(err: Exception) -> str | None:
    """One line for a failure of the machine or the network rather than of DeepInfer (a missing file, no
    permission, no route to the Hugging Face Hub), with what to do; None for anything else (a bug, which
    should show its traceback)."""
    network = [ConnectionError, TimeoutError]
    for module, name in (("httpx", "TransportError"), ("requests", "ConnectionError")):
        if module in sys.modules:  # the error can only come from a library that was imported
            network.append(getattr(sys.modules[module], name))
    if isinstance(err, tuple(network)):
        return (
            f"network error: {type(err).__name__}: {err}; check the connection (proxy, HF_ENDPOINT), or set "
            "HF_HUB_OFFLINE=1 to use models already in the Hugging Face cache"
        )
    hub_errors = sys.modules.get("huggingface_hub.errors")
    if hub_errors is not None and isinstance(err, hub_errors.HfHubHTTPError):
        return (
            f"the Hugging Face Hub refused the request: {str(err).splitlines()[0]}; check the model id and --revision"
        )
    if isinstance(err, OSError):
        return (
            f"{type(err).__name__}: {err} (reading or writing the model, the tokenizer or the cache failed; "
            "check the paths, their permissions and the free disk space)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = underscores_to_dashes(argv, commands)
    try:
        expanded, config = expand_config(argv, commands)
    except DeepInferError as err:
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    args = parser.parse_args(expanded)
    # what the user typed after the command, and what the config file gave, apart: a command that validates
    # its settings (serve) names each value's source, and lets $DEEPINFER_* fill in only what neither gave
    args.command_line, args.config_file = argv[argv.index(args.command) + 1 :], config
    try:
        if hasattr(args, "model_tag"):  # serve, generate: MODEL, --model or the config file's model
            args.model = resolve_model(args.model_tag, args.model, config.model if config else None)
        configure_logging(resolve_level(getattr(args, "log_level", None)))
        return args.run(args)
    except DeepInferError as err:
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # invalid parameters (e.g. sampling) raise ValueError with the field named
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        message = _environment_error(err)
        if message is None:
            raise
        print(f"deepinfer: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
