"""`deepinfer serve`'s settings (flags, --config file, $DEEPINFER_*) validated as one model before the port
is bound or the model loads: refusals name the value as the user spelled it, the precedence is command line >
config file > environment > defaults, and the flags' defaults are the model's."""

from __future__ import annotations

import argparse
import json
import socket
import time

import pytest

from deepinfer_core.cli import main, serve
from deepinfer_core.cli.settings import ServeSettings

# every DEEPINFER_* variable a field reads, so that the caller's environment cannot leak into a test
_FIELD_VARS = [f"DEEPINFER_{name.upper()}" for name in ServeSettings.model_fields]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for var in (*_FIELD_VARS, "DEEPINFER_LOGGING_LEVEL"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def busy_port():
    """A port something already listens on: a command that binds before validating fails on it instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


class Captured(Exception):
    """Raised by the stand-in build_state: the settings got as far as loading the model."""


@pytest.fixture
def settings_of(monkeypatch, capsys):
    """settings_of(*args) -> what `deepinfer serve ARGS` would load the model with (nothing is loaded)."""
    seen = []

    def build_state(settings):
        seen.append(settings)
        raise Captured

    monkeypatch.setattr(serve, "build_state", build_state)

    def run(*args: str):
        with pytest.raises(Captured):
            main(["serve", "--port", "0", *args])
        capsys.readouterr()
        return seen.pop()

    return run


@pytest.fixture
def refusal(monkeypatch, capsys, busy_port):
    """refusal(*args) -> stderr of `deepinfer serve ARGS`, which must fail with status 2, one line and no
    traceback, before binding (the port given is taken) and before loading (build_state is never called)."""

    def build_state(settings):
        pytest.fail("the model was loaded despite an invalid setting")

    monkeypatch.setattr(serve, "build_state", build_state)

    def run(*args: str) -> str:
        try:
            status = main(["serve", "--port", str(busy_port), *args])
        except SystemExit as exit:  # argparse's refusals
            status = exit.code
        err = capsys.readouterr().err
        assert status == 2, err
        assert "Traceback" not in err and "is in use" not in err, err
        return err

    return run


def test_max_num_seqs_0_is_refused_at_once_by_the_installed_command(run_cli, busy_port):
    started = time.monotonic()
    result = run_cli(["serve", "--max-num-seqs", "0", "--port", str(busy_port), "--accelerator", "cpu"])
    assert result.returncode == 2, result
    assert result.stderr == "deepinfer: error: --max-num-seqs must be at least 1, got 0\n"
    assert time.monotonic() - started < 60


def test_an_environment_variable_is_named(refusal, monkeypatch):
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "0")
    assert refusal() == "deepinfer: error: $DEEPINFER_MAX_NUM_SEQS must be at least 1, got '0'\n"
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "many")
    assert "$DEEPINFER_MAX_NUM_SEQS must be an integer, got 'many'" in refusal()


@pytest.mark.parametrize("key", ["max-num-seqs", "max_num_seqs"])
def test_a_config_file_key_is_named_as_written(refusal, tmp_path, key):
    config = tmp_path / "serve.yaml"
    config.write_text(f"{key}: 0\n")
    assert refusal("--config", str(config)) == (
        f"deepinfer: error: {key} in --config {config} must be at least 1, got 0\n"
    )


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--port", "-1", "must be at least 0"),
        ("--port", "65536", "must be at most 65535"),
        ("--max-num-seqs", "0", "must be at least 1"),
        ("--max-num-batched-tokens", "0", "must be at least 1"),
        ("--max-model-len", "0", "must be at least 1"),
        ("--block-size", "0", "must be at least 1"),
        ("--num-kv-blocks", "-3", "must be at least 1"),
        ("--kv-cache-memory-bytes", "0", "must be at least 1"),
        ("--kv-cache-memory-gb", "0", "must be greater than 0"),
        ("--max-waiting-requests", "-1", "must be at least 0"),
        ("--max-request-body-mb", "0", "must be at least 1"),
        ("--shutdown-grace-period", "-5", "must be at least 0"),
        ("--seed", "-1", "must be at least 0"),
        ("--timeout-keep-alive", "0", "must be greater than 0"),
        ("--timeout-request-header", "-1", "must be greater than 0"),
        ("--timeout-request-body", "0", "must be greater than 0"),
        ("--limit-concurrency", "0", "must be at least 1"),
    ],
)
def test_each_limit_is_refused_with_its_flag_and_constraint(refusal, flag, value, says):
    assert refusal(f"{flag}={value}") == f"deepinfer: error: {flag} {says}, got {value}\n"


def test_every_wrong_value_is_named_at_once(refusal, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TIMEOUT_REQUEST_BODY", "soon")
    error = refusal("--max-num-seqs", "0", "--port", "70000")
    assert error.startswith("deepinfer: error: ") and error.count("\n") == 1
    for part in ("--max-num-seqs must be", "--port must be at most 65535", "$DEEPINFER_TIMEOUT_REQUEST_BODY must"):
        assert part in error, error


def test_gpu_memory_utilization_and_the_kv_cache_size(refusal, monkeypatch):
    monkeypatch.setenv("DEEPINFER_GPU_MEMORY_UTILIZATION", "1.5")
    assert "$DEEPINFER_GPU_MEMORY_UTILIZATION must be at most 1, got '1.5'" in refusal()
    monkeypatch.delenv("DEEPINFER_GPU_MEMORY_UTILIZATION")
    assert "--kv-cache-memory-bytes or --kv-cache-memory-gb, not both" in refusal(
        "--kv-cache-memory-gb", "1", "--kv-cache-memory-bytes", "1G"
    )
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MEMORY_BYTES", "4.5K")
    assert "$DEEPINFER_KV_CACHE_MEMORY_BYTES: '4.5K' is not an integer" in refusal()


def test_engram_placement_is_one_of_its_choices(settings_of, monkeypatch):
    assert settings_of().engram_placement == "auto"
    assert settings_of("--engram-placement", "HOST").engram_placement == "host"
    monkeypatch.setenv("DEEPINFER_ENGRAM_PLACEMENT", "device")
    assert settings_of().engram_placement == "device"


def test_a_wrong_engram_placement_is_refused_with_its_flag_or_variable(refusal, monkeypatch):
    assert "argument --engram-placement: invalid choice: 'gpu'" in refusal("--engram-placement", "gpu")
    monkeypatch.setenv("DEEPINFER_ENGRAM_PLACEMENT", "gpu")
    assert "$DEEPINFER_ENGRAM_PLACEMENT must be one of 'auto', 'host' or 'device', got 'gpu'" in refusal()


def test_the_engram_placement_reaches_the_model(monkeypatch):
    from deepinfer_core.cli.settings import Given, load_settings
    from deepinfer_core.engine import llm

    def loading(**kwargs):
        raise Captured(kwargs["engram_placement"])

    monkeypatch.setattr(llm, "LLM", loading)
    with pytest.raises(Captured, match="^host$"):
        serve.build_state(load_settings(Given("flag", {"engram_placement": "host"}, {})))


def test_prefix_replay_is_exact_unless_asked(settings_of, monkeypatch):
    assert settings_of().prefix_replay == "exact"
    assert settings_of("--prefix-replay", "Bounded").prefix_replay == "bounded"
    monkeypatch.setenv("DEEPINFER_PREFIX_REPLAY", "bounded")
    assert settings_of().prefix_replay == "bounded"
    assert settings_of("--prefix-replay", "exact").prefix_replay == "exact"  # the flag wins


def test_the_prefix_replay_reaches_the_model(monkeypatch):
    from deepinfer_core.cli.settings import Given, load_settings
    from deepinfer_core.engine import llm

    def loading(**kwargs):
        raise Captured(kwargs["prefix_replay"])

    monkeypatch.setattr(llm, "LLM", loading)
    with pytest.raises(Captured, match="^bounded$"):
        serve.build_state(load_settings(Given("flag", {"prefix_replay": "bounded"}, {})))


def test_a_wrong_prefix_replay_is_refused_with_its_flag_or_variable(refusal, monkeypatch):
    assert "argument --prefix-replay: invalid choice: 'approx'" in refusal("--prefix-replay", "approx")
    monkeypatch.setenv("DEEPINFER_PREFIX_REPLAY", "approx")
    assert "$DEEPINFER_PREFIX_REPLAY must be one of 'exact' or 'bounded', got 'approx'" in refusal()


def test_the_environment_overrides_a_default_but_not_a_flag(settings_of, monkeypatch):
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MEMORY_BYTES", "4G")  # the flags' suffixes work here too
    monkeypatch.setenv("DEEPINFER_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    settings = settings_of()
    assert settings.max_num_seqs == 5 and settings.kv_cache_memory_bytes == 4 << 30
    assert settings.enable_prefix_caching is False and settings.api_key == "from-env"
    assert settings.max_num_batched_tokens == 2048  # untouched: the default
    settings = settings_of("--max-num-seqs", "7", "--enable-prefix-caching", "--api-key", "from-flag")
    assert settings.max_num_seqs == 7 and settings.enable_prefix_caching is True and settings.api_key == "from-flag"
    # a flag given at its default value still wins over the variable
    assert settings_of("--max-num-seqs", "64").max_num_seqs == 64


def test_the_config_file_overrides_the_environment_and_the_command_line_the_file(settings_of, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("DEEPINFER_MAX_WAITING_REQUESTS", "3")
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 9\nmax_num_batched_tokens: 512\nallowed-origins: [https://a.example]\n")
    settings = settings_of("--config", str(config))
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (9, 512)
    assert settings.max_waiting_requests == 3  # not in the file: the environment's
    assert settings.allowed_origins == ["https://a.example"]
    settings = settings_of("--config", str(config), "--max-num-seqs", "11")
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (11, 512)


def test_where_the_accelerator_came_from_is_kept(settings_of, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    settings = settings_of()
    assert settings.accelerator == "cpu" and settings.origin("accelerator").name == "$DEEPINFER_ACCELERATOR"
    settings = settings_of("--accelerator", "cpu")
    assert settings.origin("accelerator").kind == "flag"
    assert settings_of().origin("max_num_seqs").kind == "default"


def test_the_new_server_flags(settings_of, monkeypatch):
    settings = settings_of()
    assert (settings.timeout_keep_alive, settings.timeout_request_header, settings.timeout_request_body) == (5, 30, 30)
    assert settings.limit_concurrency is None
    assert (settings.allowed_origins, settings.allowed_methods, settings.allowed_headers) == ([], ["*"], ["*"])
    assert settings.allow_credentials is False
    monkeypatch.setenv("DEEPINFER_ALLOWED_HEADERS", '["Authorization"]')
    settings = settings_of(
        "--timeout-keep-alive=2.5",
        "--timeout-request-header=10",
        "--timeout-request-body=1",
        "--limit-concurrency=100",
        '--allowed-origins=["https://a.example", "http://localhost:3000"]',
        '--allowed-methods=["GET", "POST"]',
        "--allow-credentials",
    )
    assert (settings.timeout_keep_alive, settings.timeout_request_header, settings.timeout_request_body) == (2.5, 10, 1)
    assert settings.limit_concurrency == 100
    assert settings.allowed_origins == ["https://a.example", "http://localhost:3000"]
    assert settings.allowed_methods == ["GET", "POST"] and settings.allowed_headers == ["Authorization"]
    assert settings.allow_credentials is True


def test_cors_lists_must_be_json_lists_of_strings(refusal, monkeypatch):
    error = refusal("--allowed-origins", '"*"')
    assert "argument --allowed-origins: expected a JSON list of strings" in error
    assert "argument --allowed-methods: 'GET' is not JSON" in refusal("--allowed-methods", "GET")
    monkeypatch.setenv("DEEPINFER_ALLOWED_ORIGINS", '{"origin": "*"}')
    assert "$DEEPINFER_ALLOWED_ORIGINS: expected a JSON list of strings" in refusal()


def test_the_keep_alive_timeout_reaches_uvicorn(monkeypatch, capsys):
    import uvicorn

    from deepinfer_core.cli import listen
    from deepinfer_core.serve import app

    configs = []

    class Server:
        def __init__(self, config, on_started, *args, **kwargs):
            configs.append(config)

        def run(self, sockets):
            pass

    monkeypatch.setattr(serve, "build_state", lambda settings: argparse.Namespace(api_key=None))
    monkeypatch.setattr(app, "build_app", lambda state, cors=None: object())
    monkeypatch.setattr(listen, "ListeningServer", Server)
    assert main(["serve", "--port", "0", "--timeout-keep-alive", "2.5"]) == 0
    [config] = configs
    assert isinstance(config, uvicorn.Config) and config.timeout_keep_alive == 2.5
    capsys.readouterr()


def _serve_parser() -> argparse.ArgumentParser:
    commands = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(commands)
    return commands.choices["serve"]


def test_the_flags_defaults_are_the_settings_defaults():
    actions = {action.dest: action for action in _serve_parser()._actions}
    fields = set(ServeSettings.model_fields)
    assert fields - set(actions) == set(), "settings without a flag"
    for name in fields - {"model"}:  # the positional MODEL and --model are resolved together
        assert actions[name].default == ServeSettings.default(name), name
    assert ServeSettings.default("model") is None and actions["model"].default is None


def test_the_help_shows_the_new_flags_with_their_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    entries = {}  # "--flag METAVAR" -> its help, from the options part (not the usage lines)
    for line in out[out.index("options:") :].splitlines():
        if line.startswith("  -"):
            name, _, text = line.strip().partition("  ")
            entries[name] = text.strip()
        elif line.startswith("    ") and entries:
            entries[name] += " " + line.strip()
    assert entries["--timeout-keep-alive SECONDS"].endswith("closed after this long (default: 5)")
    assert entries["--timeout-request-header SECONDS"].endswith("(default: 30)")
    assert entries["--timeout-request-body SECONDS"].endswith("(default: 30)")
    assert entries["--limit-concurrency N"].endswith(
        "(default: none: the open-file limit, raised to its maximum at start, less 128)"
    )
    origins = entries["--allowed-origins JSON"]
    assert (
        "unlike vLLM" in origins and "on a LAN" in origins and origins.endswith("(default: []: no CORS headers at all)")
    )
    assert entries["--allowed-methods JSON"].endswith(f"(default: {json.dumps(['*'])})")
    assert entries["--allowed-headers JSON"].endswith(f"(default: {json.dumps(['*'])})")
    assert entries["--allow-credentials"].endswith("(default: False)")
    assert "DEEPINFER_MAX_NUM_SEQS" in out  # the description says the environment works too


def test_the_window_snapshot_budget_comes_from_its_flag_or_variable(settings_of, monkeypatch):
    assert settings_of().window_snapshot_gb == 4.0
    assert settings_of("--window-snapshot-gb", "0.5").window_snapshot_gb == 0.5
    monkeypatch.setenv("DEEPINFER_WINDOW_SNAPSHOT_GB", "0")
    assert settings_of().window_snapshot_gb == 0


def test_the_window_snapshot_budget_reaches_the_model(monkeypatch):
    from deepinfer_core.cli.settings import Given, load_settings
    from deepinfer_core.engine import llm

    def loading(**kwargs):
        raise Captured(str(kwargs["window_snapshot_gb"]))

    monkeypatch.setattr(llm, "LLM", loading)
    with pytest.raises(Captured, match=r"^1\.5$"):
        serve.build_state(load_settings(Given("flag", {"window_snapshot_gb": 1.5}, {})))


def test_a_negative_window_snapshot_budget_is_refused(refusal):
    assert "--window-snapshot-gb must be at least 0, got -1" in refusal("--window-snapshot-gb", "-1")


def test_several_ranks_and_nodes_settings_are_checked(refusal, settings_of):
    assert "--data-parallel-size must be at least 1, got 0" in refusal("--data-parallel-size", "0")
    assert "--enable-eplb balances experts between ranks" in refusal("--enable-eplb")
    assert "eplb_config has unknown keys ['window']" in refusal(
        "-dp", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"window": 3}'
    )
    assert "--data-parallel-size-local 3 is more than --data-parallel-size 2" in refusal("-dp", "2", "-dpl", "3")
    assert "--headless runs another node's ranks" in refusal("--headless", "-dp", "2", "-dpl", "1")
    assert "--data-parallel-start-rank is for --headless nodes" in refusal("-dp", "2", "-dpr", "1")
    chosen = settings_of("-dp", "4", "-dpl", "2", "-dpa", "10.0.0.1", "-dpp", "13345")  # a head node's
    assert (chosen.data_parallel_size, chosen.data_parallel_size_local, chosen.data_parallel_address,
            chosen.data_parallel_rpc_port, chosen.headless) == (4, 2, "10.0.0.1", 13345, False)  # fmt: skip
