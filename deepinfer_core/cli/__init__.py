"""The `deepinfer` command line. Errors meant for people are printed as one message, never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys

from deepinfer_core import __version__
from deepinfer_core.backend.hookspecs import API_VERSION
from deepinfer_core.cli import backends, conformance, generate, serve
from deepinfer_core.errors import DeepInferError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Serve DeepSeek MoE models on any accelerator.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__} (contract v{API_VERSION})")
    commands = parser.add_subparsers(dest="command", required=True)
    backends.add_parser(commands)
    generate.add_parser(commands)
    conformance.add_parser(commands)
    serve.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="deepinfer: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except DeepInferError as err:
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # invalid parameters (e.g. sampling) raise ValueError with the field named
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
