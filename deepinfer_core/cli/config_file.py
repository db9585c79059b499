"""`--config FILE`: flag values read from a YAML file, with vLLM's semantics.

Keys are a command's long flag names, with dashes or underscores (`max-model-len`, `max_model_len`); `model`
names the model. A `true` switches an on/off flag on; `false` switches a --x/--no-x flag off and leaves a
plain switch at its default; a list repeats a repeatable flag (`stop: ["###", "END"]`) and is passed as JSON to
a flag that takes JSON (`allowed-origins: ["https://a.example"]`); a mapping is passed as JSON
(`override-generation-config: {max_new_tokens: 256}`); `null` leaves the default. The file's values go in right
after the command name, so the same flag given on the command line overrides them.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer_core.errors import DeepInferError

__all__ = ["ConfigFile", "expand_config", "underscores_to_dashes"]


@dataclass(frozen=True)
class ConfigFile:
    """What a --config file gave: its path, its `model`, its flags as command-line arguments, and each flag's
    dest -> the key as written in the file (for messages)."""

    path: str
    model: str | None
    args: tuple[str, ...]
    keys: dict[str, str]


def _config_path(args: list[str]) -> str | None:
    """The FILE of `--config FILE` / `--config=FILE` among a command's arguments, if given once."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.removeprefix("--config="))
    if len(found) > 1:
        raise DeepInferError(f"--config is given {len(found)} times; give one file")
    return found[0] if found else None


def _load(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).expanduser().read_text()
    except OSError as err:
        raise DeepInferError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise DeepInferError(f"--config {path} is not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DeepInferError(
            f"--config {path} must be a mapping of flag names to values (e.g. `max-model-len: 4096`), "
            f"not a {type(data).__name__}"
        )
    return data


def _long_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Flag name (no dashes in front) -> action, for the flags a config file may set."""
    return {
        option[2:]: action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        for option in action.option_strings
        if option.startswith("--") and option != "--config"
    }


def _tokens(path: str, key: str, name: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line arguments that set flag --name to value."""
    flag = f"--{name}"
    if value is None:
        return []
    if action.nargs == 0:  # an on/off switch
        if not isinstance(value, bool):
            raise DeepInferError(f"--config {path}: {key} is an on/off flag; set it to true or false, not {value!r}")
        if value:
            return [flag]
        if isinstance(action, argparse.BooleanOptionalAction) and not name.startswith("no-"):
            return [f"--no-{name}"]
        return []
    if isinstance(value, dict) or (isinstance(value, list) and action.metavar == "JSON"):
        return [f"{flag}={json.dumps(value)}"]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [f"{flag}={item}" for item in value]
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            return [flag, *map(str, value)]
        raise DeepInferError(f"--config {path}: {key} takes one value, not a list")
    if isinstance(value, bool):  # YAML's true/false for a flag that takes a value
        value = str(value).lower()
    return [f"{flag}={value}"]


def underscores_to_dashes(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """argv with `--max_model_len` spelled `--max-model-len` (vLLM accepts both) where the command has that flag."""
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if at is None or argv[at] not in commands:
        return argv
    known = commands[argv[at]]._option_string_actions
    out = argv[: at + 1]
    for i, arg in enumerate(argv[at + 1 :], start=at + 1):
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        out.append(dashed + eq + value if arg.startswith("--") and "_" in name and dashed in known else arg)
    return out


def expand_config(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> tuple[list[str], ConfigFile | None]:
    """(argv with the values of the command's --config file put right after the command name, what the file
    gave). argv is returned as is, with None, when it has no --config."""
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if at is None or argv[at] not in commands:
        return argv, None
    command, parser = argv[at], commands[argv[at]]
    path = _config_path(argv[at + 1 :]) if "--config" in parser._option_string_actions else None
    if path is None:
        return argv, None
    flags = _long_flags(parser)
    tokens: list[str] = []
    keys: dict[str, str] = {}
    model = None
    for key, value in _load(path).items():
        name = str(key).replace("_", "-")
        if name == "model":
            if value is not None and not isinstance(value, str):
                raise DeepInferError(f"--config {path}: model must be a folder or Hub id, not {value!r}")
            model = value
            continue
        if name not in flags:
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DeepInferError(
                f"--config {path}: unknown key {key!r}{hint}; keys are the long flag names of "
                f"`deepinfer {command}` (see deepinfer {command} --help)"
            )
        tokens += _tokens(path, str(key), name, flags[name], value)
        keys[flags[name].dest] = str(key)
    return [*argv[: at + 1], *tokens, *argv[at + 1 :]], ConfigFile(path, model, tuple(tokens), keys)
