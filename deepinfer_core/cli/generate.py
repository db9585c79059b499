"""`deepinfer generate`: one prompt, streamed to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from deepinfer_core.cli.flags import HelpFormatter, add_common_flags, add_model_flags
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.structured.params import StructuredOutputsParams

__all__ = ["add_parser"]

log = logging.getLogger("deepinfer.generate")


def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer_core.engine.llm import LLM  # loads torch-heavy modules only for this command

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        structured_outputs=_structured_outputs(args),
    )
    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        revision=args.revision,
        download_dir=args.download_dir,
        accelerator=args.accelerator,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        engram_placement=args.engram_placement,
        batch_invariant=args.batch_invariant,
        progress=sys.stderr.isatty(),
    )
    log.info("backend %s on %s, model %s", llm.backend.info.name, llm.backend.device.name, llm.model_name)
    output = None
    for output in llm.stream(args.prompt if args.prompt is not None else _token_ids(args.prompt_token_ids), params):
        sys.stdout.write(output.new_text if llm.tokenizer is not None else f"{output.new_token_ids[0]} ")
        sys.stdout.flush()
    completion = output.outputs[0]
    sys.stdout.write("\n")
    log.info("%d tokens, finish reason %s", len(completion.token_ids), completion.finish_reason)
    return 0


def _structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The output constraint the flags ask for (at most one: argparse keeps them exclusive)."""
    if args.json_schema is not None:
        return StructuredOutputsParams(json=_read(args.json_schema, "--json-schema"))
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=_read(args.grammar, "--grammar"))
    return None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag}: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None


def add_parser(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate a completion for one prompt, streamed to the terminal",
        description="Generate a completion for one prompt, streamed to stdout (statistics go to stderr).\n"
        "With no MODEL, the embedded demo model (random weights).",
        epilog="""examples:
  deepinfer generate deepseek-ai/DeepSeek-V3 --prompt "The capital of France is" --temperature 0
  deepinfer generate --prompt "Hello" --seed 7 --stop "###" --stop $'\\n'   # bash: $'\\n' is a newline
  deepinfer generate --prompt "A person:" --json-schema person.schema.json""",
        formatter_class=HelpFormatter,
    )
    add_model_flags(p)
    prompt = p.add_argument_group("prompt (one of)").add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (default: none)")
    prompt.add_argument(
        "--prompt-token-ids",
        help="the prompt as comma-separated token ids, for models without a tokenizer (default: none)",
    )
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", metavar="N", type=int, default=64, help="tokens to generate at most")
    sampling.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="1: none")
    sampling.add_argument("--presence-penalty", type=float, default=0.0, help="0: none")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0, help="0: none")
    sampling.add_argument("--seed", type=int, default=None, help="this request's sampling seed (default: not seeded)")
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string, repeatable: --stop '###' --stop $'\\n' (default: none)",
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    structured = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON this schema (a file) accepts")
    structured.add_argument("--regex", help="the output matches this regular expression")
    structured.add_argument(
        "--choice", action="append", default=[], help="the output is one of these strings, repeatable: --choice yes"
    )
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar (a file)")
    p.add_argument_group("engine").add_argument(
        "--batch-invariant", action="store_true", help="run the backend's batch-invariant mode"
    )
    add_common_flags(p)
    p.set_defaults(run=_cmd_generate)
