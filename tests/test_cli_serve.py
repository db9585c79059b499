"""`deepinfer serve` as the installed console script: the port is taken before the model loads, "listening"
only once it answers, vLLM's flags (positional MODEL, --config YAML, --override-generation-config), help
with defaults, and one-line errors."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer_core.cli import main


def deepinfer_exe() -> str:
    exe = shutil.which("deepinfer", path=str(Path(sys.executable).parent))
    assert exe, "the deepinfer console script is not installed next to this Python"
    return exe


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("DEEPINFER_ACCELERATOR", "DEEPINFER_API_KEY", "DEEPINFER_LOGGING_LEVEL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([deepinfer_exe(), *args], capture_output=True, text=True, env=clean_env(**env), timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, status: int = 2) -> None:
    assert result.returncode == status, result
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("deepinfer: error: ") and result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_a_busy_port_fails_before_the_model_loads():
    started = time.monotonic()
    assert run(["--version"]).returncode == 0
    imports = time.monotonic() - started  # what any command costs before it does anything
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = run(["serve", "--port", str(port), "--accelerator", "cpu"])
        elapsed = time.monotonic() - started
    assert_one_line_error(result, f"port {port} on 127.0.0.1 is in use (", "pick another with --port")
    # nothing was loaded: loading the demo model logs its RANDOM-weights warning, and takes seconds
    assert "RANDOM weights" not in result.stderr and "backend" not in result.stderr
    assert elapsed < 2 * imports + 5, (elapsed, imports)


class LiveServer:
    """A `deepinfer serve` subprocess whose merged stdout/stderr lines are read as they come."""

    def __init__(self, *args: str, **env: str) -> None:
        command = [deepinfer_exe(), "serve", "--port", "0", "--accelerator", "cpu", *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(**env)
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        """The first match of pattern in the next lines of output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"deepinfer serve exited ({self.process.wait()}) before {pattern!r}:\n" + self.log())
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"no {pattern!r} in the output within {timeout} s:\n" + self.log())

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


def test_config_file_flags_override_listening_and_the_generation_default(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "served_model_name: from-config\n"  # underscores as well as dashes
        "max-model-len: 512\n"
        "num-kv-blocks: 16\n"
        "enable-prefix-caching: false\n"
        "override-generation-config: {max_new_tokens: 7}\n"
    )
    server = LiveServer("--config", str(config), "--max-model-len", "1024")
    try:
        url = server.wait_for(r"deepinfer: listening on (http://127\.0\.0\.1:(\d+)) ")
        # the line comes once the server answers: a request sent the moment it appears is served at once
        assert httpx.get(url[1] + "/health", timeout=5).status_code == 200
        before = server.log()
        assert "serving deepinfer-demo-deepseek-v4-random as 'from-config', context 1024 tokens" in before
        assert "16 KV blocks of 128 tokens, prefix caching off" in before  # from the file
        assert before.index("Application startup complete") < before.index("listening on")
        server.wait_for(r'"GET /health HTTP/1\.1" 200')  # uvicorn's access log, on at --uvicorn-log-level info

        client = openai.OpenAI(
            base_url=url[1] + "/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"Connection": "close"},
            timeout=60,
        )
        [model] = client.models.list().data
        assert model.id == "from-config" and model.model_extra["max_model_len"] == 1024  # the flag won
        reply = client.chat.completions.create(
            model="from-config",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            extra_body={"ignore_eos": True},
        )  # no max_tokens: --override-generation-config's max_new_tokens applies
        assert reply.usage.completion_tokens == 7 and reply.choices[0].finish_reason == "length"
        client.close()
    finally:
        status = server.stop()
    assert status == 0, server.log()
    server.wait_for("server stopped")
    assert "Traceback" not in server.log()


def parse_error(capsys, args: list[str]) -> str:
    """stderr of `deepinfer ARGS`, run in this process, that must fail with status 2 before running anything."""
    try:
        status = main(args)
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    captured = capsys.readouterr()
    assert status == 2 and "Traceback" not in captured.err, (status, captured)
    return captured.err


def test_unknown_or_mistyped_config_keys_are_named(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max-model-length: 4096\n")
    error = parse_error(capsys, ["serve", "--config", str(config)])
    assert error == (
        f"deepinfer: error: --config {config}: unknown key 'max-model-length' (did you mean max-model-len?); keys "
        "are the long flag names of `deepinfer serve` (see deepinfer serve --help)\n"
    )
    config.write_text("enforce-eager: sometimes\n")
    assert "enforce-eager is an on/off flag" in parse_error(capsys, ["serve", "--config", str(config)])
    config.write_text("- port\n- 80\n")
    assert "must be a mapping of flag names" in parse_error(capsys, ["serve", "--config", str(config)])
    assert "none.yaml: cannot read it" in parse_error(capsys, ["serve", "--config", str(tmp_path / "none.yaml")])
    config.write_text("port: eighty\n")  # the file's values are checked as the flags' are
    assert "argument --port: invalid int value: 'eighty'" in parse_error(capsys, ["serve", "--config", str(config)])


def test_model_is_positional_or_flag_but_given_once(capsys, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    expected = f"model path {missing} is not a directory"
    assert_one_line_error(run(["serve", missing, "--port", "0", "--accelerator", "cpu"]), expected)
    assert_one_line_error(run(["serve", "--model", missing, "--port", "0", "--accelerator", "cpu"]), expected)
    error = parse_error(capsys, ["serve", missing, "--model", missing + "-other"])
    assert error == (
        f"deepinfer: error: the model is given twice, as MODEL {missing!r} and as --model {missing + '-other'!r}; "
        "give it once\n"
    )


def test_an_unreadable_checkpoint_file_is_one_line_not_a_traceback(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    (tmp_path / "model.safetensors").mkdir()  # safetensors raises a bare OSError reading it
    result = run(["serve", str(tmp_path), "--port", "0", "--accelerator", "cpu"])
    assert_one_line_error(result, "OSError", "check the paths", status=1)


def help_entries(text: str) -> dict[str, str]:
    """Each option of a --help text -> its help, whitespace collapsed."""
    entries: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if re.match(r"  (-|MODEL )", line):
            name, _, rest = line.strip().partition("  ")
            entries[name] = rest
        elif name and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def help_text(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    serve, generate = help_entries(help_text(capsys, "serve")), help_entries(help_text(capsys, "generate"))
    for entries in (serve, generate):
        without = [name for name, text in entries.items() if "(default: " not in text and name != "-h, --help"]
        assert len(entries) > 15 and not without, without
    assert serve["--port PORT"].endswith("(default: 8000)")
    assert serve["--host HOST"].endswith("(default: 127.0.0.1)")
    assert serve["--dtype {auto,bfloat16,float,float16,float32,half}"].endswith("(default: auto)")
    assert serve["--enable-prefix-caching, --no-enable-prefix-caching"].endswith("(default: True)")
    assert serve["--uvicorn-log-level LEVEL"].endswith("(default: info)")
    assert generate["--max-tokens N"].endswith("(default: 64)")
    assert serve["MODEL"].endswith("(default: the embedded demo model: DeepSeek-V4 architecture, random weights)")


def test_flags_refused_before_anything_loads(capsys):
    assert "invalid choice: 'float64'" in parse_error(capsys, ["serve", "--dtype", "float64"])
    error = parse_error(capsys, ["serve", "--override-generation-config", '{"temperature": 0.5}'])
    assert "temperature is not supported yet (only max_new_tokens)" in error
    assert "is not JSON" in parse_error(capsys, ["serve", "--override-generation-config", "max_new_tokens=5"])
    assert "'4.5K' is not an integer" in parse_error(capsys, ["serve", "--max-model-len", "4.5K"])
    assert "'1.5' is not a fraction in (0, 1]" in parse_error(capsys, ["serve", "--gpu-memory-utilization", "1.5"])
    error = parse_error(capsys, ["serve", "--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens must be given" in error
    assert "not valid JSON" in parse_error(capsys, ["serve", "--speculative-config", "ngram"])
