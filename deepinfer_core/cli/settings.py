"""The settings of `deepinfer serve` in one pydantic model, validated before the port is bound or the model
loads, whose errors name each setting as its user spelled it and say what it must be.

Precedence, highest first: the command line, the --config file (its values reach the parser as arguments
placed before the real ones), $DEEPINFER_<FIELD> (DEEPINFER_MAX_NUM_SEQS, DEEPINFER_API_KEY,
DEEPINFER_ACCELERATOR, ...; an empty variable counts as unset), the defaults below, which the flags' help
shows. Only values given explicitly reach the model as arguments, so a variable overrides a default but
never a flag. The log level is not a field: every command reads it before it runs (logging_setup: --log-level,
else $DEEPINFER_LOGGING_LEVEL, vLLM's VLLM_LOGGING_LEVEL spelling).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from deepinfer_core.cli.config_file import ConfigFile
from deepinfer_core.cli.flags import DTYPES, explicit_values, human_readable_int
from deepinfer_core.engine.block_manager import PREFIX_REPLAYS
from deepinfer_core.errors import DeepInferError
from deepinfer_core.model.v41_engram import ENGRAM_PLACEMENTS

__all__ = [
    "ENV_PREFIX",
    "KV_CACHE_DTYPES",
    "UVICORN_LOG_LEVELS",
    "Given",
    "Origin",
    "ServeSettings",
    "from_command_line",
    "generation_config",
    "json_list",
    "load_settings",
]

ENV_PREFIX = "DEEPINFER_"
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's --uvicorn-log-level
# vLLM's generation-config keys that set defaults for the sampling fields a request leaves out
_LATER_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _json(value: Any, example: str) -> Any:
    if not isinstance(value, str):  # already parsed: a flag's value, or a --config mapping or list
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{value!r} is not JSON ({err}); e.g. '{example}'") from None


def generation_config(value: str | dict) -> dict:
    """--override-generation-config: a JSON object; max_new_tokens (vLLM's key) is the default max_tokens of
    requests that give none."""
    value = _json(value, '{"max_new_tokens": 256}')
    if not isinstance(value, dict):
        raise ValueError(f'expected a JSON object such as {{"max_new_tokens": 256}}, got {json.dumps(value)}')
    for key, item in value.items():
        if key in _LATER_GENERATION_KEYS:
            raise ValueError(f"{key} is not supported yet (only max_new_tokens); clients set {key} in each request")
        if key != "max_new_tokens":
            raise ValueError(f"unknown key {key!r}; the supported key is max_new_tokens")
        if not isinstance(item, int) or isinstance(item, bool) or item < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {item!r}")
    return value


def json_list(value: str | list) -> list:
    """A JSON list of strings (vLLM's --allowed-origins, --allowed-methods, --allowed-headers)."""
    value = _json(value, '["https://a.example"]')
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f'expected a JSON list of strings such as ["https://a.example"], got {json.dumps(value)}')
    return value


def _suffixed(value: Any) -> Any:
    """An integer written as the flags take it (32k, 4G), for values read from the environment."""
    if not isinstance(value, str):
        return value
    try:
        return human_readable_int(value)
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


Count = Annotated[int, BeforeValidator(_suffixed)]  # an integer that also takes 32k, 4G
GenerationConfig = Annotated[dict, BeforeValidator(generation_config)]
JsonList = Annotated[list[str], BeforeValidator(json_list)]
Dtype = Annotated[Literal[DTYPES], BeforeValidator(_lower)]
KvCacheDtype = Annotated[Literal[KV_CACHE_DTYPES], BeforeValidator(_lower)]
EngramPlacement = Annotated[Literal[ENGRAM_PLACEMENTS], BeforeValidator(_lower)]
PrefixReplay = Annotated[Literal[PREFIX_REPLAYS], BeforeValidator(_lower)]
UvicornLogLevel = Annotated[Literal[UVICORN_LOG_LEVELS], BeforeValidator(_lower)]


@dataclass(frozen=True)
class Origin:
    """Where a setting came from: kind is "flag", "config", "env" or "default"; name says it for people
    (`--max-num-seqs`, `max-num-seqs in --config serve.yaml`, `$DEEPINFER_MAX_NUM_SEQS`, `the default`)."""

    kind: str
    name: str


@dataclass(frozen=True)
class Given:
    """Values given explicitly by one source (the command line, a config file): field -> value, and
    field -> how the user spelled it, for messages."""

    kind: str
    values: dict[str, Any]
    names: dict[str, str]


class ServeSettings(BaseSettings):
    """What `deepinfer serve` runs with; each field is the flag of the same name (`--max-num-seqs` is
    max_num_seqs), its help says what it does."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, enable_decoding=False, extra="forbid", frozen=True
    )

    # the model
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    accelerator: str | None = None  # backend/selection.py reads $DEEPINFER_ACCELERATOR the same way
    dtype: Dtype = "auto"
    max_model_len: Count | None = Field(None, ge=1)
    engram_placement: EngramPlacement = "auto"
    # the engine
    kv_cache_dtype: KvCacheDtype = "auto"
    seed: int | None = Field(None, ge=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: Count | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)  # deprecated: kv_cache_memory_bytes in GiB
    num_kv_blocks: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_prefix_caching: bool = True
    prefix_replay: PrefixReplay = "exact"
    window_snapshot_gb: float = Field(4.0, ge=0)
    batch_invariant: bool = False
    enforce_eager: bool = False
    speculative_config: str | None = None  # vLLM's JSON; engine/speculative.py parses and checks it
    # several ranks (parallel/data_parallel.py)
    data_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: str | None = None  # vLLM's JSON; parallel/eplb_runtime.EplbConfig parses and checks it
    data_parallel_size_local: int | None = Field(None, ge=1)  # several nodes (parallel/nodes.py): ranks here
    data_parallel_start_rank: int = Field(0, ge=0)
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = Field(29550, ge=1, le=65534)
    headless: bool = False
    # the HTTP server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None
    override_generation_config: GenerationConfig | None = None
    max_waiting_requests: int = Field(512, ge=0)  # 0: none wait beyond the max_num_seqs running
    api_key: str | None = None
    max_request_body_mb: int = Field(8, ge=1)
    shutdown_grace_period: int = Field(60, ge=0)
    uvicorn_log_level: UvicornLogLevel = "info"
    disable_uvicorn_access_log: bool = False
    timeout_keep_alive: float = Field(5, gt=0)
    timeout_request_header: float = Field(30, gt=0)
    timeout_request_body: float = Field(30, gt=0)
    limit_concurrency: int | None = Field(None, ge=1)  # None: derived from the open-file limit at start
    allowed_origins: JsonList = []
    allowed_methods: JsonList = ["*"]
    allowed_headers: JsonList = ["*"]
    allow_credentials: bool = False

    _origins: dict[str, Origin] = PrivateAttr(default_factory=dict)

    @field_validator("api_key")
    @classmethod
    def _no_empty_key(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, value: str | None) -> str | None:
        from deepinfer_core.engine.speculative import SpeculativeConfig, SpeculativeError  # torch: only when given

        if value is not None:
            try:
                SpeculativeConfig.parse(value)
            except SpeculativeError as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("eplb_config")
    @classmethod
    def _eplb(cls, value: str | None) -> str | None:
        from deepinfer_core.parallel.eplb_runtime import EplbConfig

        if value is not None:
            raw = _json(value, '{"window_size": 1000, "step_interval": 10000}')
            if not isinstance(raw, dict):
                raise ValueError(f'expected a JSON object such as {{"window_size": 1000}}, got {json.dumps(raw)}')
            try:
                EplbConfig.parse(raw)
            except DeepInferError as err:
                raise ValueError(str(err)) from None
        return value

    @model_validator(mode="after")
    def _eplb_needs_expert_parallel_ranks(self) -> ServeSettings:
        if self.enable_eplb and not (self.data_parallel_size > 1 and self.enable_expert_parallel):
            raise ValueError("--enable-eplb balances experts between ranks: give --data-parallel-size 2 or more and "
                             "--enable-expert-parallel")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _nodes(self) -> ServeSettings:
        local, size, start = self.data_parallel_size_local, self.data_parallel_size, self.data_parallel_start_rank
        if local is not None and local > size:
            raise ValueError(f"--data-parallel-size-local {local} is more than --data-parallel-size {size}")
        if self.headless and (local is None or not 0 < start < size):
            raise ValueError("--headless runs another node's ranks: give --data-parallel-size-local and "
                             "--data-parallel-start-rank (1 or more, below --data-parallel-size)")  # fmt: skip
        if not self.headless and start:
            raise ValueError("--data-parallel-start-rank is for --headless nodes; the head runs ranks from 0")
        return self

    @model_validator(mode="after")
    def _one_kv_cache_size(self) -> ServeSettings:
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give --kv-cache-memory-bytes or --kv-cache-memory-gb, not both")
        return self

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field `name`; the flags' defaults come from here."""
        return cls.model_fields[name].get_default(call_default_factory=True)

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache size asked for, from --kv-cache-memory-bytes or the deprecated --kv-cache-memory-gb."""
        if self.kv_cache_memory_gb is not None:
            return int(self.kv_cache_memory_gb * (1 << 30))
        return self.kv_cache_memory_bytes

    def origin(self, name: str) -> Origin:
        """Where field `name`'s value came from."""
        return self._origins.get(name) or _origin(name, ())


def _env_var(name: str) -> str | None:
    """The environment variable that sets field `name`, as spelled there (pydantic-settings ignores case)."""
    wanted = (ENV_PREFIX + name).upper()
    return next((key for key, value in os.environ.items() if key.upper() == wanted and value), None)


def _origin(name: str, given: tuple[Given, ...]) -> Origin:
    for source in given:
        if name in source.values:
            return Origin(source.kind, source.names.get(name, name))
    env = _env_var(name)
    return Origin("env", f"${env}") if env else Origin("default", "the default")


_PHRASES = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false (or 1/0, yes/no, on/off)",
    "bool_type": "must be true or false",
    "literal_error": "must be one of {expected}",
    "string_type": "must be a string",
}


def _shown(value: Any) -> Any:
    """5 rather than 5.0 in messages."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _describe(error: dict, given: tuple[Given, ...]) -> str:
    """One pydantic error as a sentence that names the setting as its user spelled it."""
    loc = error["loc"]
    if error["type"] == "value_error" and not loc:  # a model validator's: names its flags itself
        return str(error["ctx"]["error"])
    where = _origin(str(loc[0]), given).name + "".join(f" item {i}" for i in loc[1:] if isinstance(i, int))
    if error["type"] == "value_error":
        return f"{where}: {error['ctx']['error']}"
    phrase = _PHRASES.get(error["type"])
    if phrase is None:
        return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}"
    bounds = {key: _shown(value) for key, value in error.get("ctx", {}).items()}
    shown = repr(error["input"]) if isinstance(error["input"], str) else _shown(error["input"])
    return f"{where} {phrase.format(**bounds)}, got {shown}"


def load_settings(*given: Given) -> ServeSettings:
    """The validated settings from the explicitly given values, highest precedence first (the command line,
    then the config file), then the environment and the defaults; a DeepInferError naming every wrong one."""
    values: dict[str, Any] = {}
    for source in reversed(given):
        values.update(source.values)
    try:
        settings = ServeSettings(**values)
    except ValidationError as err:
        raise DeepInferError("; ".join(_describe(e, given) for e in err.errors())) from None
    settings._origins.update({name: _origin(name, given) for name in ServeSettings.model_fields})
    return settings


def from_command_line(
    add_flags: Callable[[argparse.ArgumentParser], None],
    command_line: list[str],
    config: ConfigFile | None,
    model: str | None,
) -> ServeSettings:
    """The validated settings from the arguments typed after the command (`command_line`, parsed by a parser
    that `add_flags` builds), the --config file's (`config`), the model the CLI resolved from MODEL, --model or
    the file, then the environment and the defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    typed = explicit_values(add_flags, command_line)
    from_flags = _fields_among(typed)
    from_file = {} if config is None else _fields_among(explicit_values(add_flags, list(config.args)))
    if model is not None:
        (from_flags if "model_tag" in typed or "model" in typed else from_file)["model"] = model
    given = [Given("flag", from_flags, flags)]
    if config is not None:
        names = {dest: f"{key} in --config {config.path}" for dest, key in config.keys.items()}
        given.append(Given("config", from_file, names))
    return load_settings(*given)


def _fields_among(values: dict[str, Any]) -> dict[str, Any]:
    """The settings among parsed flags: not MODEL and --model (resolved apart), nor --config and --log-level."""
    return {name: value for name, value in values.items() if name in ServeSettings.model_fields and name != "model"}
