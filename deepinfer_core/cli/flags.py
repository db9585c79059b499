"""Flags that `deepinfer serve` and `deepinfer generate` share, spelled as vLLM spells them, and the help
formatter that shows every flag's default."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from deepinfer_core.backend.selection import ENV_VAR
from deepinfer_core.cli.logging_setup import LEVELS, LOGGING_ENV_VAR
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model.v41_engram import ENGRAM_PLACEMENTS

__all__ = [
    "DTYPES",
    "HelpFormatter",
    "add_common_flags",
    "add_model_flags",
    "explicit_values",
    "flag_type",
    "human_readable_int",
    "resolve_model",
]

DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")  # vLLM's --dtype choices
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to every flag's help, except where the help already says what the default is;
    keeps the line breaks of descriptions and epilogs (examples)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return super()._get_help_string(action)


def human_readable_int(value: str) -> int:
    """An integer, optionally with vLLM's suffixes: k/m/g/t for powers of 1000 ("25.6k" = 25600), K/M/G/T for
    powers of 1024 ("4G" = 4 * 2**30)."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    try:
        if match is None:
            return int(text)
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        return int(number) * _BINARY[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an integer (suffixes: k/m/g/t for 1000s, K/M/G/T for 1024s without decimals, "
            "e.g. 32k or 4G)"
        ) from None


def flag_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a converter whose ValueError says what is wrong (argparse would print only
    "invalid <name> value")."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = convert.__name__
    return parse


def explicit_values(add_flags: Callable[[argparse.ArgumentParser], None], args: list[str]) -> dict[str, Any]:
    """dest -> value of the flags and positionals that `args` gives, leaving out those it does not give
    (a parser built by `add_flags` whose every default is argparse.SUPPRESS): what a setting's default or
    environment variable may fill in."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(args))


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--config and --log-level."""
    p = parser.add_argument_group("config file and logging")
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flag values from this YAML file, as vLLM does: keys are the long flag names (dashes or "
        "underscores: max-model-len or max_model_len), `true` for on/off flags; flags on the command line "
        "override the file (default: none)",
    )
    p.add_argument(
        "--log-level",
        metavar="LEVEL",
        type=str.lower,
        choices=LEVELS,
        default=None,
        help=f"level of DeepInfer's log lines: {', '.join(LEVELS)} (default: ${LOGGING_ENV_VAR}, else info)",
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model (positional MODEL or --model), where it comes from, and how it is loaded."""
    p = parser.add_argument_group("model")
    p.add_argument(
        "model_tag",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="Hugging Face checkpoint folder, or Hub id such as deepseek-ai/DeepSeek-V3 (default: the embedded "
        "demo model: DeepSeek-V4 architecture, random weights)",
    )
    p.add_argument("--model", metavar="MODEL", default=None, help="the same as the positional MODEL (default: none)")
    p.add_argument(
        "--tokenizer", metavar="NAME_OR_PATH", default=None, help="tokenizer folder or Hub id (default: the model's)"
    )
    p.add_argument(
        "--revision", metavar="REV", default=None, help="Hub branch, tag or commit of the model (default: main)"
    )
    p.add_argument(
        "--download-dir",
        metavar="DIR",
        default=None,
        help="where Hub downloads go (default: the Hugging Face cache, $HF_HUB_CACHE)",
    )
    p.add_argument(
        "--accelerator",
        metavar="NAME",
        default=None,
        help=f"backend name, alias or 'auto' (default: ${ENV_VAR}, else auto)",
    )
    p.add_argument(
        "--dtype",
        type=str.lower,
        choices=DTYPES,
        default="auto",
        help="compute dtype; auto: bfloat16 on an accelerator for 16-bit checkpoints, else the checkpoint's "
        "dtype; half = float16, float = float32",
    )
    p.add_argument(
        "--max-model-len",
        metavar="N",
        type=human_readable_int,
        default=None,
        help="context limit in tokens, e.g. 4096 or 32k (default: the model's)",
    )
    p.add_argument(
        "--engram-placement",
        type=str.lower,
        choices=ENGRAM_PLACEMENTS,
        default="auto",
        help="where DeepSeek-V4.1's Engram tables live: host memory (each step's rows are copied to the device), "
        "the device, or auto: the host when they would take over a tenth of the device's memory, the device on a "
        "cpu backend; other models ignore it",
    )


def resolve_model(positional: str | None, flag: str | None, from_config: str | None) -> str | None:
    """The model to load: MODEL or --model (an error if both are given and differ), else the config file's."""
    if positional is not None and flag is not None and positional != flag:
        raise DeepInferError(f"the model is given twice, as MODEL {positional!r} and as --model {flag!r}; give it once")
    return positional or flag or from_config
