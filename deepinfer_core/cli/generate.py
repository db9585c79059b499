"""`deepinfer generate`: one prompt, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from deepinfer_core.backend.selection import ENV_VAR
from deepinfer_core.sampling.params import SamplingParams

__all__ = ["add_parser"]


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
    )
    llm = LLM(
        model=args.model,
        accelerator=args.accelerator,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        batch_invariant=args.batch_invariant,
        progress=sys.stderr.isatty(),
    )
    print(
        f"deepinfer: backend {llm.backend.info.name} on {llm.backend.device.name}, model {llm.model_name}",
        file=sys.stderr,
    )
    output = None
    for output in llm.stream(args.prompt if args.prompt is not None else _token_ids(args.prompt_token_ids), params):
        sys.stdout.write(output.new_text if llm.tokenizer is not None else f"{output.new_token_ids[0]} ")
        sys.stdout.flush()
    completion = output.outputs[0]
    sys.stdout.write("\n")
    print(f"deepinfer: {len(completion.token_ids)} tokens, finish reason {completion.finish_reason}", file=sys.stderr)
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the embedded demo model)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument(
        "--prompt-token-ids", help="the prompt as comma-separated token ids (for models without a tokenizer)"
    )
    p.add_argument("--accelerator", default=None, help=f"backend name, alias or 'auto' (default: ${ENV_VAR} or auto)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--batch-invariant", action="store_true", help="run the backend's batch-invariant mode")
    p.set_defaults(run=_cmd_generate)
